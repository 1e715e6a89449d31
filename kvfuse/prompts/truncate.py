"""Which turns to drop when a conversation outgrows the context window. Pure functions.

The oldest turns go first, whole (a user message with the answers and tool messages after it),
and system (or developer) messages at the start always stay, as does the last message: the
model needs its instructions and the question it is asked.

The cut is the oldest turn start whose tail fits. ``drop_oldest_turns`` states the rule as a
scan over every cut (the reference: one ``fits`` call per cut); ``first_fitting`` finds the same
cut with O(log n) calls, since a tail that fits still fits with a turn less: it gallops back from
the last turn (the shortest tail, the cheapest to render), then halves the interval. A caller whose
``fits`` renders and tokenizes the tail (``PromptBuilder.encode_chat``) thereby renders
O(log turns) tails, most of them about the context window's size, instead of every one of
them: one request cannot cost the server turns^2 renders.
"""

from __future__ import annotations

from typing import Callable

_KEPT_ROLES = ("system", "developer")


def turn_starts(messages: list[dict]) -> tuple[int, list[int]]:
    """``(head, starts)``: how many leading system messages always stay, and the index of every
    message a kept tail may start at (each user message after the first turn), oldest first:
    the kept messages for cut ``i`` are ``messages[:head] + messages[starts[i]:]``."""
    head = _head(messages)
    return head, [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]


def drop_oldest_turns(
    messages: list[dict], fits: Callable[[list[dict]], bool]
) -> list[dict] | None:
    """The longest tail of turns that ``fits``, behind the leading system messages; ``messages``
    unchanged when it fits already; None when even the last turn alone does not fit. The
    reference rule, asking ``fits`` of every cut in turn (``first_fitting`` finds the same cut
    with O(log n) calls)."""
    if fits(messages):
        return messages
    head, starts = turn_starts(messages)
    for start in starts:  # drop turns from the oldest until what is left fits
        kept = messages[:head] + messages[start:]
        if fits(kept):
            return kept
    return None


def first_fitting(n: int, fits: Callable[[int], bool]) -> int | None:
    """The least ``i`` in ``[0, n)`` with ``fits(i)``, for ``fits`` false up to some point and
    true from there on (a tail that fits still fits with a turn less); None when ``fits(n - 1)``
    is false. ``fits`` is asked at most about ``2 log2(n) + 2`` times, never twice for one ``i``:
    from ``n - 1`` backwards in doubling steps until a cut does not fit, then by halving."""
    if n <= 0:
        return None
    hi = n - 1  # fits (checked first)
    if not fits(hi):
        return None
    step, lo = 1, hi - 1
    while lo >= 0 and fits(lo):
        hi, step = lo, step * 2
        lo = hi - step
    lo = max(lo, -1)  # lo does not fit (or is before the first cut)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def without_oldest(messages: list[dict], dropped: int) -> list[dict]:
    """``messages`` less the ``dropped`` oldest after the leading system messages: what
    ``drop_oldest_turns`` kept, given how many it dropped (for a caller that goes on with the
    conversation)."""
    head = _head(messages)
    return messages[:head] + messages[head + dropped :]


def _head(messages: list[dict]) -> int:
    """How many leading messages are system (or developer) messages, always kept."""
    head = 0
    while head < len(messages) and messages[head].get("role") in _KEPT_ROLES:
        head += 1
    return head
