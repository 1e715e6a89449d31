"""``kvfuse calibrate MODEL``: measure a model's blends on dev data and store its profile.

The measurements (``measure``) cover the methods and budgets given; ``choose`` picks the smallest
budget that keeps the answers, or no blending (``prefix``) when none does or none is fast
enough; the result is a ``BlendProfile`` tied to the model's fingerprint. The grid: every method
at every budget with documents computed behind BOS, and, for a chat model (whose documents follow
a system prompt), the first method again with documents computed behind the prompt's own prefix
(``document_context: prefix``). The defaults are what the built-in models' shipped profiles were
measured with.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import asdict

from kvfuse.config import BlendOptions
from kvfuse.config.profiles import BlendProfile

from . import fictional_qa
from .choose import Targets, choose
from .measure import Report, asks_in_chat, configurations, measure

METHODS = ("hkvd", "sinks+hkvd")
RATIOS = (0.05, 0.1, 0.15, 0.3, 0.6)


def calibrate(
    engine,
    command: str,
    items: int = 30,
    split: str = "dev",
    documents: int = 5,
    methods: Sequence[str] = METHODS,
    ratios: Sequence[float] = RATIOS,
    contexts: Sequence[str] | None = None,
    targets: Targets = Targets(),
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[BlendProfile, Report]:
    """Measure ``engine``'s model and return its profile (not saved) with the measurements."""
    data = fictional_qa.items(split, items, documents)
    if contexts is None:
        contexts = ("bos", "prefix") if asks_in_chat(engine) else ("bos",)
    base = BlendOptions(recompute_ratio=0.15, document_context=contexts[0])
    variants = [{"method": methods[0], "document_context": c} for c in contexts[1:]]
    report = measure(
        engine, data, configurations(methods, ratios, base, variants), progress=progress
    )
    choice = choose(report.measurements(), targets)
    blend = {"method": choice.method, "recompute_ratio": choice.ratio}
    if choice.row is not None and choice.blends:
        blend.update(dict(choice.row.extra))
    from kvfuse import __version__

    meta = {
        "split": split,
        "items": items,
        "documents": documents,
        "targets": asdict(targets),
        "kvfuse": __version__,
        "date": datetime.date.today().isoformat(),
    }
    model = engine.model
    profile = BlendProfile(
        model.name, model.fingerprint, blend, choice.reason, command, report.rows(), meta
    )
    return profile, report
