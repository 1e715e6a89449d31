"""Which blend a model should use: the smallest recompute budget that keeps its answers.

Pure functions over measurements (``kvfuse calibrate`` makes them on the dev split of fictional
QA): each row is one (method, budget) with its accuracy as a fraction of full prefill's, its KL
as a fraction of full reuse's, and its TTFT as a fraction of a full prefill's.

``choose`` takes the smallest budget whose row meets both quality targets (among rows of that
budget, the lowest KL, then the method listed first). When no measured budget meets them, or the
one that does is not faster than a prefill by ``min_speedup``, blending does not pay for that
model: the answer is ``prefix`` (the documents are reused only as an exact prompt prefix, so the
answers are a full prefill's), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Measurement:
    """One blend setting measured against full prefill on the same items."""

    method: str
    ratio: float
    accuracy: float  # correct answers, as a fraction of full prefill's correct answers
    kl: float  # mean KL(full prefill || blend), as a fraction of full reuse's
    ttft: float  # median TTFT, as a fraction of a full prefill's
    extra: tuple[
        tuple[str, object], ...
    ] = ()  # options beyond method and budget (e.g. the check layer)


@dataclass(frozen=True)
class Targets:
    accuracy: float = 0.95  # at least this fraction of full prefill's accuracy
    kl: float = 0.5  # at most this fraction of full reuse's KL
    # a blend must be this much faster than a prefill: below it, blending risks answers for a gain
    # that timing noise and a disk read can erase, and the prefix path (exact answers) is preferred
    min_speedup: float = 1.2


@dataclass(frozen=True)
class Choice:
    method: str  # a blend method, or "prefix" (no blending)
    ratio: float  # 1.0 for "prefix": every document token is computed
    reason: str
    row: Measurement | None = None

    @property
    def blends(self) -> bool:
        return self.method != "prefix"


def meets(row: Measurement, targets: Targets) -> bool:
    return row.accuracy >= targets.accuracy and row.kl <= targets.kl


def choose(rows: Sequence[Measurement], targets: Targets = Targets()) -> Choice:
    """The blend to use given ``rows`` (see the module docstring)."""
    good = [(r.ratio, r.kl, i, r) for i, r in enumerate(rows) if meets(r, targets)]
    if not good:
        best = min(rows, key=lambda r: (r.kl, -r.accuracy), default=None)
        seen = f"; the best measured: {describe(best)}" if best else ""
        return Choice(
            "prefix",
            1.0,
            f"no measured budget reaches accuracy >= {targets.accuracy:g} of full "
            f"prefill and KL <= {targets.kl:g} of full reuse{seen}",
        )
    row = min(good)[3]
    if row.ttft > 1.0 / targets.min_speedup:
        return Choice(
            "prefix",
            1.0,
            f"{describe(row)} keeps the answers but is not {targets.min_speedup:g}x "
            "faster than a prefill",
            row,
        )
    return Choice(
        row.method, row.ratio, f"the smallest budget that keeps the answers: {describe(row)}", row
    )


def describe(row: Measurement) -> str:
    extra = "".join(f" {k}={v}" for k, v in row.extra)
    return (
        f"{row.method}{extra} at {row.ratio:g} (accuracy {row.accuracy:.2f} of full prefill, KL {row.kl:.2f} "
        f"of full reuse, TTFT {row.ttft:.2f} of a prefill)"
    )
