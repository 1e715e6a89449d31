"""Which turns to drop when a conversation outgrows the context window. A pure function.

The oldest turns go first, whole (a user message with the answers and tool messages after it),
and system (or developer) messages at the start always stay, as does the last message: the
model needs its instructions and the question it is asked.
"""

from __future__ import annotations

from typing import Callable

_KEPT_ROLES = ("system", "developer")


def drop_oldest_turns(
    messages: list[dict], fits: Callable[[list[dict]], bool]
) -> list[dict] | None:
    """The longest tail of turns that ``fits``, behind the leading system messages; ``messages``
    unchanged when it fits already; None when even the last turn alone does not fit."""
    if fits(messages):
        return messages
    head = _head(messages)
    starts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    if (
        messages
        and messages[-1].get("role") == "user"
        and len(messages) - 1 not in starts
        and len(messages) - 1 > head
    ):
        starts.append(len(messages) - 1)
    for start in starts:  # drop turns from the oldest until what is left fits
        kept = messages[:head] + messages[start:]
        if fits(kept):
            return kept
    return None


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
