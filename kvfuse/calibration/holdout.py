"""The held-out part of calibration: items the choice never sees, and the rule that checks the
choice on them.

``split``: per source, each example's place is fixed by a hash of its key (``source:index``,
sha256, so the same on any machine and independent of the other examples), and the first
``round(fraction * n)`` of a source's examples in that order are held out. The two parts are
disjoint by example (one example is never in both, whatever its form), and every source with at
least two examples is in both.

``check``: a chosen blend is measured again, with full prefill, on the holdout. If the holdout's
lower bound of answers kept (``interval``, the choice's confidence) is below the answers target,
the choice falls back to ``prefix`` (documents reused only as an exact prefix: full prefill's
answers), and the reason says what the holdout showed. A ``prefix`` choice is not measured again:
its answers are full prefill's by construction. Without a holdout (fraction 0) the choice stands
unchecked, and the profile says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

from .choose import Choice, Targets, describe
from .interval import Kept

T = TypeVar("T")


def _rank(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def split(items: Sequence[T], fraction: float) -> tuple[list[T], list[T]]:
    """(choice part, holdout part) of ``items`` (objects with ``source`` and ``key``), each in the
    items' order; see the module docstring."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the holdout fraction must be in [0, 1), got {fraction}")
    held: set[str] = set()
    for source in dict.fromkeys(it.source for it in items):
        keys = sorted({it.key for it in items if it.source == source}, key=_rank)
        count = round(fraction * len(keys))
        if fraction > 0 and len(keys) >= 2:
            count = min(max(count, 1), len(keys) - 1)  # both parts get some of every source
        held.update(keys[:count])
    return [it for it in items if it.key not in held], [it for it in items if it.key in held]


def check(choice: Choice, holdout: Kept | None, targets: Targets = Targets()) -> Choice:
    """``choice`` as it stands, or ``prefix`` when the holdout's lower bound of answers kept is
    below ``targets.accuracy`` (module docstring). ``holdout`` None: not measured."""
    if not choice.blends or holdout is None:
        return choice
    low, high = holdout.bounds(targets.confidence)
    seen = (
        f"on the held-out items it kept {holdout.kept}/{holdout.n} answers of full prefill "
        f"({holdout.point:.2f} [{low:.2f}, {high:.2f}])"
    )
    if low >= targets.accuracy:
        return Choice(choice.method, choice.ratio, f"{choice.reason}; {seen}", choice.row)
    what = describe(choice.row, targets) if choice.row else f"{choice.method} at {choice.ratio:g}"
    return Choice(
        "prefix",
        1.0,
        f"{what} was chosen, but {seen}: the lower bound is below {targets.accuracy:g}, so no "
        "blending",
        choice.row,
    )
