"""``DelegatingTier(inner)``: a tier that is ``inner`` in every respect, for wrappers that change
one part of a tier (``EncryptedTier`` seals values, the testkit's ``ThrottledTier`` slows reads)
and must pass everything else through unchanged.

Why a base: each wrapper used to forward every ``Tier`` method by hand, and a method added to
``Tier`` later would silently take ``Tier``'s default in a wrapper (``keys`` raising, ``entries``
None, ``read_with`` reading through ``get``) instead of the inner tier's answer.
``tests/unit/test_delegating_tier.py`` checks that every public method and attribute of ``Tier``
is forwarded here.

Attributes: ``name``, ``stats``, ``clock``, ``observer``, ``holds_entries``, ``batch_reads``,
``streams_reads``, ``capacity_bytes`` and ``reports_puts`` are ``inner``'s (the store sets
``clock`` and ``observer`` on every tier: setting them on the wrapper sets them on ``inner``). A
subclass overrides one with a class attribute. A subclass that changes what reads return (or how
long they take) overrides ``get``, ``get_many`` and ``read_range``, and must also set
``streams_reads = False`` and ``read_with = Tier.read_with`` (reading through its own ``get``):
otherwise the store's streaming read goes to ``inner`` around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier

T = TypeVar("T")


def _inners(attribute: str, settable: bool = False) -> property:
    """A property that is ``self.inner``'s ``attribute`` (setting it sets inner's, if settable)."""

    def get(self):
        return getattr(self.inner, attribute)

    def set(self, value) -> None:
        setattr(self.inner, attribute, value)

    return property(get, set if settable else None, doc=f"``inner.{attribute}``")


class DelegatingTier(Tier):
    """``inner`` behind a wrapper: every ``Tier`` method and attribute forwards to it."""

    def __init__(self, inner: Tier) -> None:
        # no Tier.__init__: its own stats and clock would hide (and reset) inner's
        self.inner = inner

    # -- attributes: inner's -------------------------------------------------------------------

    name = _inners("name")
    stats = _inners("stats")
    holds_entries = _inners("holds_entries")
    batch_reads = _inners("batch_reads")
    streams_reads = _inners("streams_reads")
    capacity_bytes = _inners("capacity_bytes")
    reports_puts = _inners("reports_puts")
    clock = _inners("clock", settable=True)  # the store sets these two on every tier
    observer = _inners("observer", settable=True)

    # -- reads ----------------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def get(self, key: ChunkKey) -> Blob | None:
        return self.inner.get(key)

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        return self.inner.get_many(keys)

    def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | memoryview | None:
        return self.inner.read_range(key, start, stop)

    def read_with(
        self, key: ChunkKey, reader: Callable[[Callable[[memoryview], int], int], T]
    ) -> T | None:
        return self.inner.read_with(key, reader)

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        return self.inner.keys(limit)

    def entries(self) -> int | None:
        return self.inner.entries()

    def used_bytes(self) -> int | None:
        return self.inner.used_bytes()

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        return self.inner.tenant_usage()

    # -- writes (expires_at passed on only when given, as ``put_many_expiring`` does) -----------

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        if expires_at is None:
            self.inner.put(key, value)
        else:
            self.inner.put(key, value, expires_at)

    def put_many(
        self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None
    ) -> None:
        if expires_at is None:
            self.inner.put_many(items)
        else:
            self.inner.put_many(items, expires_at=expires_at)

    # -- expiry ---------------------------------------------------------------------------------

    def expiry(self, key: ChunkKey) -> float | None:
        return self.inner.expiry(key)

    def expiries(self, keys: Iterable[ChunkKey]) -> list[float | None]:
        return self.inner.expiries(keys)

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        return self.inner.extend(key, expires_at)

    def extend_many(self, keys: Iterable[ChunkKey], expires_at: float) -> list[bool]:
        return self.inner.extend_many(keys, expires_at)

    def expire(self) -> int:
        return self.inner.expire()

    # -- removal --------------------------------------------------------------------------------

    def delete(self, key: ChunkKey) -> bool:
        return self.inner.delete(key)

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        return self.inner.delete_many(keys)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def clear(self) -> int:
        return self.inner.clear()

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
