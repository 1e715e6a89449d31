"""``kvfuse calibrate``'s blend options as text (``--sources``, ``--documents``), the table it
prints from a profile and its progress lines when stderr is not a terminal: pure (the progress
log holds only when it last spoke), so the CLI stays a thin layer and the rules are table-tested."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from .sources import SOURCES


def parse_sources(text: str | None, available: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """The sources to calibrate on, and a note for the user (None: nothing to say). Named
    sources must be known and present (ValueError saying which and how to fix it); none named:
    every source whose data is there, with a note when some are missing."""
    if text is None:
        missing = [s for s in SOURCES if s not in available]
        note = (
            f"calibrating on {', '.join(available)} only: the data of {', '.join(missing)} is not "
            "there (set KVFUSE_DATA to the evaluation data folder)"
            if missing
            else None
        )
        return tuple(available), note
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in names if s not in SOURCES]
    if bad or not names:
        raise ValueError(
            f"unknown source {bad[0] if bad else '(none)'}; use a list of: {', '.join(SOURCES)}"
        )
    absent = [s for s in names if s not in available]
    if absent:
        raise ValueError(
            f"the data of {', '.join(absent)} is not there (set KVFUSE_DATA to the evaluation "
            "data folder, or use --sources fictional)"
        )
    return names, None


def parse_documents(text: str) -> tuple[int, ...]:
    """``--documents``: ``N`` or ``MIN-MAX`` (passages per prompt), 1..64."""
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--documents: expected N or MIN-MAX, e.g. 4-10, got {text!r}") from None
    if not 1 <= low <= high <= 64:
        raise ValueError(f"--documents: expected 1 <= MIN <= MAX <= 64, got {text!r}")
    return tuple(range(low, high + 1))


def _row(row: dict) -> str:
    if "kept" not in row:  # a profile measured before answers kept were recorded
        return f"  {row['config']:>28}  correct {row['correct']:>3}/{row['items']}"
    out = (
        f"  {row['config']:>28}  kept {row['kept']:>3}/{row['full_correct']:<3} "
        f"{row['point']:.2f} [{row['lower']:.2f}, {row['upper']:.2f}]  +{row['gained']:<2} "
        f"KL {row['kl']:.3f}  TTFT {row['ttft_ms']:.0f} ms"
    )
    if row.get("eliminated_after") is not None:
        n = row["eliminated_after"]
        out += f"  eliminated after {n} item{'' if n == 1 else 's'}"
    return out


def table(measured: Sequence[dict], meta: dict) -> list[str]:
    """The lines ``kvfuse calibrate`` prints: the items measured, a row per setting (answers
    kept / full prefill's correct answers, point, [lower, upper] at the profile's confidence,
    answers gained, KL, TTFT), then the holdout's line."""
    conf = meta.get("confidence", 0.95)
    part, held = meta.get("choice", {}), meta.get("holdout_part", {})
    lines = [
        f"  choice part: {part.get('items', '?')} items {part.get('sources', {})}; holdout: "
        f"{held.get('items', 0)} items {held.get('sources', {})}; bounds one-sided at {conf:g}",
        f"  {'setting':>28}  answers kept vs full prefill, point [lower, upper], gained",
    ]
    lines += [_row(r) for r in measured]
    gone = meta.get("elimination") or {}
    if gone.get("grid_runs"):
        lines.append(
            f"  early elimination: {gone['runs']} of {gone['grid_runs']} setting runs on an item "
            f"({gone['runs'] / gone['grid_runs']:.0%} of the full grid)"
        )
    if gone.get("stopped"):
        lines.append(f"  {gone['stopped']}")
    h = meta.get("holdout") or {}
    if h.get("config"):
        lines.append(
            f"  {'holdout: ' + h['config']:>28}  kept {h['kept']:>3}/{h['full_correct']:<3} "
            f"{h['point']:.2f} [{h['lower']:.2f}, {h['upper']:.2f}]  +{h['gained']:<2} "
            f"KL {h['kl']:.3f}"
            + (f"  stopped after {h['stopped_after']} items" if h.get("stopped_after") else "")
        )
    else:
        lines.append(f"  {'holdout':>28}  not measured: {h.get('why', 'no holdout')}")
    return lines


def progress_due(
    done: int,
    total: int,
    elapsed_s: float,
    last_done: int,
    last_s: float,
    alive: int = 1,
    every_items: int = 5,
    every_s: float = 60.0,
) -> bool:
    """Whether a progress line is due after an item: the first and the last item, every
    ``every_items`` items or ``every_s`` seconds since the last line, and when measuring stops
    because no setting is left (``alive`` 0)."""
    return (
        done in (1, total)
        or alive == 0
        or done - last_done >= every_items
        or elapsed_s - last_s >= every_s
    )


def progress_line(part: str, done: int, total: int, elapsed_s: float, alive: int, of: int) -> str:
    """``kvfuse calibrate: choice part 10/156 items (6%), 312 s, 9 of 13 blend settings running``."""
    pct = 100.0 * done / total if total else 100.0
    return (
        f"kvfuse calibrate: {part} {done}/{total} items ({pct:.0f}%), {elapsed_s:.0f} s, "
        f"{alive} of {of} blend settings running"
    )


class ProgressLog:
    """Progress lines on ``stream`` (stderr that is not a terminal: logs, CI, ``nohup``), called
    as ``measure``'s progress (``(part, Progress)``); a new part starts its own count."""

    def __init__(self, stream: TextIO, every_items: int = 5, every_s: float = 60.0):
        self.stream, self.every_items, self.every_s = stream, every_items, every_s
        self.part, self.last_done, self.last_s = None, 0, 0.0

    def __call__(self, part: str, state) -> None:
        if part != self.part:
            self.part, self.last_done, self.last_s = part, 0, 0.0
        due = progress_due(
            state.done,
            state.total,
            state.elapsed_s,
            self.last_done,
            self.last_s,
            state.alive,
            self.every_items,
            self.every_s,
        )
        if due:
            line = progress_line(
                part, state.done, state.total, state.elapsed_s, state.alive, state.settings
            )
            print(line, file=self.stream, flush=True)
            self.last_done, self.last_s = state.done, state.elapsed_s
