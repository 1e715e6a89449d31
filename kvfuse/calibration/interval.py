"""How sure a measured fraction is: the Wilson score interval, and "answers kept vs full prefill".

A blend is chosen on the LOWER bound of its answers kept, not on the point estimate: 17 kept of
24 on a held-out set was what a point estimate of 0.95+ on a small dev set turned into.

``wilson(k, n, confidence)``: the Wilson score bounds of a proportion ``k/n`` with
``z = Φ⁻¹(confidence)``: each bound is one-sided at ``confidence`` (the lower bound at 0.95 is
what the choice uses); together they are a two-sided interval at ``2*confidence - 1``. ``n = 0``
says nothing: (0, 1). No continuity correction (Newcombe's method 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score bounds of ``k`` successes in ``n`` trials (module docstring)."""
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be between 0.5 and 1, got {confidence}")
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(confidence)
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    # at k = 0 or k = n the formula gives the bound exactly; clamp the rounding
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


@dataclass(frozen=True)
class Kept:
    """Answers kept by a setting vs full prefill, over the same items:

    - ``n``: items full prefill answered correctly (the reference's correct answers);
    - ``kept``: of those, items the setting also answered correctly;
    - ``gained``: items the setting answered correctly and full prefill did not. They are
      reported, never counted: ``kept / n`` is at most 1, so a setting cannot buy back lost
      answers with lucky ones.
    """

    kept: int
    n: int
    gained: int = 0

    @property
    def point(self) -> float:
        return self.kept / self.n if self.n else 0.0

    def bounds(self, confidence: float = 0.95) -> tuple[float, float]:
        return wilson(self.kept, self.n, confidence)

    def as_dict(self, confidence: float = 0.95) -> dict:
        lower, upper = self.bounds(confidence)
        return {
            "kept": self.kept,
            "full_correct": self.n,
            "gained": self.gained,
            "point": round(self.point, 4),
            "lower": round(lower, 4),
            "upper": round(upper, 4),
        }


def kept(full: Sequence[bool], other: Sequence[bool]) -> Kept:
    """``Kept`` from per-item correctness of full prefill and of a setting (the same items)."""
    if len(full) != len(other):
        raise ValueError(f"{len(full)} full-prefill results for {len(other)} of the setting")
    both = sum(1 for f, o in zip(full, other) if f and o)
    gained = sum(1 for f, o in zip(full, other) if o and not f)
    return Kept(both, sum(map(bool, full)), gained)


def needed_items(target: float, confidence: float = 0.95) -> int:
    """The fewest full-prefill-correct items for which keeping all of them reaches a lower bound
    of ``target``: below it no blend can be chosen (docs, ``kvfuse calibrate``'s warning)."""
    if not 0 < target < 1:
        return 0
    z = NormalDist().inv_cdf(confidence)
    # all kept: lower = n / (n + z^2) >= target  <=>  n >= target * z^2 / (1 - target)
    return math.ceil(target * z * z / (1 - target) - 1e-9)


def best_lower(kept: int, n: int, left: int, confidence: float = 0.95) -> float:
    """The highest lower bound a tally of ``kept`` of ``n`` can still end with after ``left`` more
    items. A remaining item adds nothing (full prefill wrong), or one to ``n`` and at most one to
    ``kept``; for a given ``n`` the bound grows with ``kept``, so the best of each ending is every
    new full-prefill-correct item kept: the maximum over ``b = 0..left`` of the bound of
    ``kept + b`` of ``n + b``. Taken over every ``b`` (not only ``b = left``), so the answer does
    not rest on the bound growing with ``b`` too."""
    if left < 0:
        raise ValueError(f"need left >= 0, got {left}")
    return max(wilson(kept + b, n + b, confidence)[0] for b in range(left + 1))


def can_reach(kept: int, n: int, left: int, target: float, confidence: float = 0.95) -> bool:
    """Whether a setting that kept ``kept`` of ``n`` full-prefill-correct answers so far can still
    end with a lower bound >= ``target`` after ``left`` more items (``best_lower``). False means
    it can never meet the answers target, whatever the remaining items hold: ``measure`` stops
    running it (early elimination, exact)."""
    if left < 0:
        raise ValueError(f"need left >= 0, got {left}")
    return any(wilson(kept + b, n + b, confidence)[0] >= target for b in range(left + 1))
