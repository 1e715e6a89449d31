"""How long the entries a request writes stay: prompt-cache retention and cache breakpoints.

Two request controls decide it (OpenAI's and Anthropic's prompt-caching fields, mapped by the
server):

- ``Retention`` (``prompt_cache_retention``): the *most* a request's entries are kept.
  ``in_memory``: the memory tier only, gone when the memory tier evicts them; a duration
  (``24h``): every tier, each entry expiring that long after it was written. No retention: the
  tiers' own policy (every tier, until evicted).
- ``Breakpoint`` (``cache_control: {"type": "ephemeral", "ttl": ...}`` or
  ``prompt_cache_breakpoint`` on a message part): the prompt's first ``position`` tokens are a
  prefix worth storing even when ``position`` is not on a chunk boundary (the partial chunk is
  stored as a tail entry, found by the next prompt with the same prefix), and kept *at least*
  ``ttl_s``: the entries of that prefix go to every tier and expire no sooner.

``write_policy`` and ``keep_until`` are the pure rules, table-tested in
``tests/unit/test_retention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfuse.durations import parse_duration

IN_MEMORY = "in_memory"


@dataclass(frozen=True)
class Retention:
    """The most a request's entries are kept: ``memory_only`` (``in_memory``) or ``ttl_s``."""

    memory_only: bool = False
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.memory_only and self.ttl_s is not None:
            raise ValueError("a retention is either in_memory or a duration, not both")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"a retention duration must be > 0 seconds, got {self.ttl_s}")

    @classmethod
    def parse(cls, value: str) -> Retention:
        """``in_memory`` or a duration (``30s``, ``10m``, ``24h``, ``7d``); ValueError otherwise."""
        if value == IN_MEMORY:
            return cls(memory_only=True)
        try:
            return cls(ttl_s=parse_duration(value))
        except ValueError as e:
            raise ValueError(f"{e}; or {IN_MEMORY!r}") from None

    def __str__(self) -> str:
        return (
            IN_MEMORY
            if self.memory_only
            else (f"{self.ttl_s:g}s" if self.ttl_s is not None else "default")
        )


@dataclass(frozen=True, order=True)
class Breakpoint:
    """The prompt's first ``position`` tokens form a prefix to store (and keep >= ``ttl_s``)."""

    position: int
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.position < 1:
            raise ValueError(
                f"a cache breakpoint must follow at least one token, got position {self.position}"
            )
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"a cache breakpoint's ttl must be > 0 seconds, got {self.ttl_s}")


def _min_ttl(end: int, breakpoints: Sequence[Breakpoint]) -> float | None:
    """The longest ttl of the breakpoints whose prefix holds tokens ``[.., end)``."""
    ttls = [b.ttl_s for b in breakpoints if b.position >= end and b.ttl_s is not None]
    return max(ttls) if ttls else None


def write_policy(
    end: int, retention: Retention | None, breakpoints: Sequence[Breakpoint], now: float
) -> tuple[float | None, bool]:
    """``(expires_at, memory_only)`` for an entry of a request's KV ending at token ``end``.

    A breakpoint's ttl is a minimum and the retention a maximum, except that a minimum beats
    ``in_memory`` (a memory-only entry could be evicted at once): the prefix of a breakpoint with
    a ttl is written to every tier with at least that ttl."""
    at_least = _min_ttl(end, breakpoints)
    if retention is None:
        return None, False  # the tiers' policy: no expiry, which outlives any minimum
    if retention.memory_only:
        return (now + at_least, False) if at_least is not None else (None, True)
    return now + max(retention.ttl_s, at_least or 0.0), False


def keep_until(
    end: int, retention: Retention | None, breakpoints: Sequence[Breakpoint], now: float
) -> float | None:
    """How long an entry this request *reuses* (ending at token ``end``) must now stay at least
    (its expiry is extended to it), or None: leave it as it is. Only a duration or a ttl asks for
    a lifetime; ``in_memory`` and no retention ask for none."""
    at_least = _min_ttl(end, breakpoints)
    ttl = retention.ttl_s if retention is not None and retention.ttl_s is not None else None
    if ttl is None and at_least is None:
        return None
    return now + max(ttl or 0.0, at_least or 0.0)
