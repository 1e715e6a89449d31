"""``kvfuse calibrate MODEL``: measure a model's blends on dev data and store its profile.

The items (``sources`` x ``forms``): dev examples of the fictional generator, MuSiQue and the
CacheBlend examples, taken in turn, each asked in one prompt form (chat or completion, labelled
passages or not, 4-10 passages, the answer's passage first, in the middle or last). They are
split (``holdout.split``) into a choice part and a holdout part the choice never sees.

On the choice part, ``measure`` runs the grid: every method at every budget with documents
computed behind BOS, and, for a chat model (whose documents follow a system prompt), the first
method again with documents computed behind the prompt's own prefix (``document_context:
prefix``). ``choose`` picks the smallest budget whose lower bound of answers kept vs full prefill
reaches the target, or ``prefix``. A setting that can no longer reach that bound is eliminated
(not run on the items left), and when none is left measuring stops: the choice is the one the
full grid would make (``measure``), at a fraction of the work. A chosen blend is then measured on the holdout, with full
prefill, and kept only if the holdout's lower bound reaches the target too (``holdout.check``).
The profile records the items (sources, forms, counts per part), the confidence, every setting's
interval and the holdout's.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict

from kvfuse.config import BlendOptions
from kvfuse.config.profiles import BlendProfile

from . import forms, holdout, sources
from .choose import Choice, Targets, choose
from .interval import Kept, kept, needed_items
from .measure import Progress, Report, asks_in_chat, configurations, measure

METHODS = ("hkvd", "sinks+hkvd")
RATIOS = (0.05, 0.1, 0.15, 0.3, 0.6)
SOURCES = sources.SOURCES
HOLDOUT = 0.4


def _part(items: Sequence[forms.CalibrationItem]) -> dict:
    """What a part of the items holds: counts per source, per form axis."""
    return {
        "items": len(items),
        "sources": dict(Counter(it.source for it in items)),
        "kinds": dict(Counter("chat" if it.form.chat else "completion" for it in items)),
        "labels": dict(Counter("labeled" if it.form.labels else "unlabeled" for it in items)),
        "documents": dict(sorted(Counter(len(it.documents) for it in items).items())),
        "positions": dict(
            Counter(it.form.position if it.answer_at is not None else "as given" for it in items)
        ),
    }


def _holdout(engine, items, report: Report, choice: Choice, targets: Targets, run) -> dict:
    """The chosen setting and full prefill on the holdout items: answers kept with its bounds
    (``{}`` when nothing is measured: no holdout, or no blend chosen). Eliminated like the grid
    (``run``): once its lower bound cannot reach the target, the check fails whatever is left."""
    if not items or not choice.blends:
        return {}
    rows = report.measurements()
    names = [n for n, o in report.configs.items() if not o.full_reuse]
    name = names[next(i for i, r in enumerate(rows) if r == choice.row)]
    held = run(items, {name: report.configs[name]}, "holdout")
    got = kept(held.tallies["full prefill"].hits, held.tallies[name].hits)
    out = {"config": name, **got.as_dict(targets.confidence), "kl": held.rows()[1]["kl"]}
    return out | _stopped(held, "holdout", targets)


def _stopped(report: Report, part: str, targets: Targets) -> dict:
    """What early elimination did to a part: ``{}`` when it ran every item, else the items
    measured of those planned and why it stopped (recorded in the profile, added to the reason)."""
    if report.stopped_after is None:
        return {}
    n, planned = report.stopped_after, report.planned
    why = (
        f"measuring the {part} stopped after {n} of {planned} items: no blend setting could reach "
        f"a lower bound of answers kept >= {targets.accuracy:g} (one-sided, "
        f"{targets.confidence:g}) any more, even with every item left kept"
    )
    return {"stopped_after": n, "planned": planned, "stopped": why}


def _runner(engine, targets: Targets, progress, eliminate: bool):
    """``measure`` with the targets' elimination (unless ``eliminate`` is off) and the progress
    callback told which part (``progress(part, Progress)``) it measures."""

    def run(items, configs, part: str) -> Report:
        tell = None if progress is None else (lambda state: progress(part, state))
        target = targets.accuracy if eliminate else None
        return measure(
            engine, items, configs, progress=tell, target=target, confidence=targets.confidence
        )

    return run


def _meta(choice_items, held_items, space, source_names, fraction, targets) -> dict:
    from kvfuse import __version__

    return {
        "split": "dev",
        "sources": {s: sources.SPLITS[s] for s in source_names},
        "forms": space.describe(),
        "items": len(choice_items) + len(held_items),
        "choice": _part(choice_items),
        "holdout_part": _part(held_items),
        "holdout_fraction": fraction,
        "confidence": targets.confidence,
        "needed_full_correct": needed_items(targets.accuracy, targets.confidence),
        "targets": asdict(targets),
        "kvfuse": __version__,
        "date": datetime.date.today().isoformat(),
    }


def calibrate(
    engine,
    command: str,
    items: int = 240,
    source_names: Sequence[str] = ("fictional",),
    space: forms.FormSpace = forms.FormSpace(),
    fraction: float = HOLDOUT,
    methods: Sequence[str] = METHODS,
    ratios: Sequence[float] = RATIOS,
    contexts: Sequence[str] | None = None,
    targets: Targets = Targets(),
    progress: Callable[[str, Progress], None] | None = None,
    eliminate: bool = True,
) -> tuple[BlendProfile, Report]:
    """Measure ``engine``'s model and return its profile (not saved) with the choice part's
    measurements (see the module docstring); ``eliminate`` False runs every setting on every
    item (``--measure-all``: the same choice, every setting's full figures)."""
    chat = asks_in_chat(engine)
    space = forms.for_model(space, chat)
    data = forms.assign(sources.examples(source_names, items), space)
    choice_items, held_items = holdout.split(data, fraction)
    if not choice_items:
        raise ValueError("no items left to choose on: use more items or a smaller holdout")
    if contexts is None:
        contexts = ("bos", "prefix") if chat else ("bos",)
    base = BlendOptions(recompute_ratio=0.15, document_context=contexts[0])
    variants = [{"method": methods[0], "document_context": c} for c in contexts[1:]]
    grid = configurations(methods, ratios, base, variants)
    run = _runner(engine, targets, progress, eliminate)
    report = run(choice_items, grid, "choice part")
    stopped = _stopped(report, "choice part", targets)
    first = choose(report.measurements(), targets)
    if stopped:
        first = dataclasses.replace(first, reason=f"{first.reason}; {stopped['stopped']}")
    held = _holdout(engine, held_items, report, first, targets, run)
    checked = Kept(held["kept"], held["full_correct"], held["gained"]) if held else None
    result = holdout.check(first, checked, targets)
    if held.get("stopped"):
        result = dataclasses.replace(result, reason=f"{result.reason}; {held['stopped']}")
    meta = _meta(choice_items, held_items, space, source_names, fraction, targets)
    done, grid_runs = report.runs()
    meta["elimination"] = {"on": eliminate, "runs": done, "grid_runs": grid_runs, **stopped}
    meta["holdout"] = held or {
        "measured": False,
        "why": "no holdout items" if not held_items else "no blend chosen (prefix is exact)",
    }
    return _profile(engine.model, result, command, report.rows(targets.confidence), meta), report


def _profile(model, result: Choice, command: str, rows: list[dict], meta: dict) -> BlendProfile:
    """The profile of ``model`` for the final choice (its blend with the options beyond method
    and budget that the chosen row measured)."""
    blend = {"method": result.method, "recompute_ratio": result.ratio}
    if result.row is not None and result.blends:
        blend.update(dict(result.row.extra))
    return BlendProfile(model.name, model.fingerprint, blend, result.reason, command, rows, meta)
