"""``kvfuse calibrate``'s blend options as text (``--sources``, ``--documents``) and the table it
prints from a profile: pure, so the CLI stays a thin layer and the rules are table-tested."""

from __future__ import annotations

from collections.abc import Sequence

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
    return (
        f"  {row['config']:>28}  kept {row['kept']:>3}/{row['full_correct']:<3} "
        f"{row['point']:.2f} [{row['lower']:.2f}, {row['upper']:.2f}]  +{row['gained']:<2} "
        f"KL {row['kl']:.3f}  TTFT {row['ttft_ms']:.0f} ms"
    )


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
    h = meta.get("holdout") or {}
    if h.get("config"):
        lines.append(
            f"  {'holdout: ' + h['config']:>28}  kept {h['kept']:>3}/{h['full_correct']:<3} "
            f"{h['point']:.2f} [{h['lower']:.2f}, {h['upper']:.2f}]  +{h['gained']:<2} "
            f"KL {h['kl']:.3f}"
        )
    else:
        lines.append(f"  {'holdout':>28}  not measured: {h.get('why', 'no holdout')}")
    return lines
