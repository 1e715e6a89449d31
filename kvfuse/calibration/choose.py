"""Which blend a model should use: the smallest recompute budget that keeps its answers.

Pure functions over measurements (``kvfuse calibrate`` makes them on the choice part of its dev
items): each row is one (method, budget) with its answers kept vs full prefill (``interval.Kept``:
of the items full prefill answered correctly, how many the blend also did), its KL as a fraction
of full reuse's, and its TTFT as a fraction of a full prefill's.

``choose`` takes the smallest budget whose row meets both quality targets (among rows of that
budget, the lowest KL, then the method listed first). The answers target is met by the LOWER
bound of the Wilson interval of answers kept at ``Targets.confidence`` (one-sided), not by the
point estimate: 20 kept of 20 is a point estimate of 1.0 but a lower bound of 0.88, not enough
for 0.95. Keeping all answers reaches a lower bound of 0.95 from 52 items on
(``interval.needed_items``); with fewer, no blend can be chosen and the answer is ``prefix``. When no measured budget meets them, or the
one that does is not faster than a prefill by ``min_speedup``, blending does not pay for that
model: the answer is ``prefix`` (the documents are reused only as an exact prompt prefix, so the
answers are a full prefill's), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .interval import Kept


@dataclass(frozen=True)
class Measurement:
    """One blend setting measured against full prefill on the same items."""

    method: str
    ratio: float
    kept: Kept  # answers kept vs full prefill (interval.Kept)
    kl: float  # mean KL(full prefill || blend), as a fraction of full reuse's
    ttft: float  # median TTFT, as a fraction of a full prefill's
    extra: tuple[
        tuple[str, object], ...
    ] = ()  # options beyond method and budget (e.g. the check layer)

    @property
    def accuracy(self) -> float:
        """The point estimate of answers kept (reported; the choice reads the lower bound)."""
        return self.kept.point


@dataclass(frozen=True)
class Targets:
    accuracy: float = 0.95  # the lower bound of answers kept vs full prefill must reach this
    kl: float = 0.5  # at most this fraction of full reuse's KL
    # a blend must be this much faster than a prefill: below it, blending risks answers for a gain
    # that timing noise and a disk read can erase, and the prefix path (exact answers) is preferred
    min_speedup: float = 1.2
    confidence: float = 0.95  # of the one-sided lower bound of answers kept


@dataclass(frozen=True)
class Choice:
    method: str  # a blend method, or "prefix" (no blending)
    ratio: float  # 1.0 for "prefix": every document token is computed
    reason: str
    row: Measurement | None = None

    @property
    def blends(self) -> bool:
        return self.method != "prefix"


def lower(row: Measurement, targets: Targets) -> float:
    return row.kept.bounds(targets.confidence)[0]


def meets(row: Measurement, targets: Targets) -> bool:
    return lower(row, targets) >= targets.accuracy and row.kl <= targets.kl


def choose(rows: Sequence[Measurement], targets: Targets = Targets()) -> Choice:
    """The blend to use given ``rows`` (see the module docstring)."""
    good = [(r.ratio, r.kl, i, r) for i, r in enumerate(rows) if meets(r, targets)]
    if not good:
        best = min(rows, key=lambda r: (-lower(r, targets), r.kl), default=None)
        seen = f"; the best measured: {describe(best, targets)}" if best else ""
        return Choice(
            "prefix",
            1.0,
            f"no measured budget keeps answers vs full prefill with a {targets.confidence:g} lower "
            f"bound >= {targets.accuracy:g} and KL <= {targets.kl:g} of full reuse{seen}",
        )
    row = min(good)[3]
    if row.ttft > 1.0 / targets.min_speedup:
        return Choice(
            "prefix",
            1.0,
            f"{describe(row, targets)} keeps the answers but is not {targets.min_speedup:g}x "
            "faster than a prefill",
            row,
        )
    return Choice(
        row.method,
        row.ratio,
        f"the smallest budget that keeps the answers: {describe(row, targets)}",
        row,
    )


def describe(row: Measurement, targets: Targets = Targets()) -> str:
    extra = "".join(f" {k}={v}" for k, v in row.extra)
    low, high = row.kept.bounds(targets.confidence)
    return (
        f"{row.method}{extra} at {row.ratio:g} (kept {row.kept.kept}/{row.kept.n} answers of full "
        f"prefill, {row.accuracy:.2f} [{low:.2f}, {high:.2f}], KL {row.kl:.2f} of full reuse, "
        f"TTFT {row.ttft:.2f} of a prefill)"
    )
