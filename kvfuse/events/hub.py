"""KV events switched on for one engine: the publisher, its tracker, and the hooks that feed them.

``open_kv_events(server_config, engine)`` (``server.kv_events`` set) binds the sockets, starts
the publisher thread and hooks the engine's cache:

- each tier gets an observer (``tiers.base.TierObserver``) offering ``stored`` / ``removed``
  notifications of prefix and tail chunks (documents, content chunks and codec variants are never
  announced, so never queued);
- the cache writer describes, before it saves them, the chunks a request stores (prompt chunks,
  breakpoint tails, history and answer chunks) and, before promoting them, the chunks it found
  in a lower tier (``describe``): their token ids and parents, which a tier put cannot see;
- deletions by key (``freed``) and by prefix (``cleared``: ``DELETE /v1/kv``) are reported by the
  writer after the store did them;
- what the disk tier already holds at start-up is announced once, by a thread of its own
  (``startup.py``).

Every hook only offers an item to the publisher's bounded inbox (never blocking, a full inbox
drops and counts). Which tier announces what ``medium``: memory ``CPU``, disk ``DISK``, Redis
``REDIS`` and S3 ``S3`` with ``ownership`` the tier's name (a shared tier: every server sharing it
can read the block; vllm-router scores it as its external tier).

``pyzmq`` and ``msgspec`` are the optional extra ``kvfuse[events]``: imported here only, with an
error naming the extra when missing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvfuse.kv.keys import ChunkKey, Namespace

from .blocks import ANNOUNCED, Span

log = logging.getLogger(__name__)

EXTRA = "pip install 'kvfuse[events]' (pyzmq and msgspec)"


def medium_of(tier) -> tuple[str, str | None]:
    """``(medium, ownership)`` of a tier by its kind (see the module docstring)."""
    kind = type(getattr(tier, "inner", tier)).__name__  # an EncryptedTier: its inner tier
    if kind == "MemoryTier":
        return "CPU", None
    if kind == "DiskTier":
        return "DISK", None
    if kind.startswith("Redis"):
        return "REDIS", tier.name
    if kind.startswith("S3"):
        return "S3", tier.name
    return kind.removesuffix("Tier").upper() or "EXTERNAL", tier.name


class _Observer:
    """A tier's observer: announced kinds only, offered with the tier's index."""

    __slots__ = ("_offer", "_tier")

    def __init__(self, offer, tier: int) -> None:
        self._offer, self._tier = offer, tier

    def stored(self, key: ChunkKey) -> None:
        if key.kind in ANNOUNCED and not key.variant:
            self._offer(("stored", self._tier, key))

    def removed(self, key: ChunkKey) -> None:
        if key.kind in ANNOUNCED and not key.variant:
            self._offer(("removed", self._tier, key))


class KVEvents:
    """The hooks' side of a running publisher (see the module docstring)."""

    def __init__(self, publisher) -> None:
        self.publisher = publisher
        self._offer = publisher.offer
        self.startup = None  # the start-up scan of the disk tier (StartupAnnouncer), if any

    def observer(self, tier: int) -> _Observer:
        return _Observer(self._offer, tier)

    def describe(self, namespace: Namespace, ids: Sequence[int], spans: Sequence[Span]) -> None:
        """``spans`` (objects with ``key``, ``start``, ``end``) of a request whose slots hold
        ``ids``: announce-able ones are described, in order, before their tier notifications."""
        todo = [s for s in spans if s.key.kind in ANNOUNCED and not s.key.variant]
        if todo:
            self._offer(
                ("describe", namespace, list(ids), [Span(s.key, s.start, s.end) for s in todo])
            )

    def freed(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self._offer(("freed", list(keys)))

    def cleared(self, prefix: str) -> None:
        self._offer(("cleared", prefix))

    def counters(self) -> dict[str, int]:
        """The publisher's and the tracker's counters, and the inbox's depth."""
        p = self.publisher
        return {
            **p.stats.snapshot(),
            **p.tracker.stats.snapshot(),
            **(self.startup.stats.snapshot() if self.startup is not None else {}),
            "queued": len(p.inbox),
            "chunks": len(p.tracker),
        }

    def close(self) -> None:
        if self.startup is not None:
            self.startup.stop()
        self.publisher.close()


def _import_wire():
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"server.kv_events needs {e.name}: {EXTRA}") from e


def open_kv_events(s, engine) -> KVEvents | None:
    """Start publishing ``engine``'s KV events as ``s`` (``ServerConfig``) says; None when the
    engine has no cache (nothing to announce; logged)."""
    cache = engine.cache
    if not cache.enabled:
        log.warning("server.kv_events is set but the cache is off: no KV events are published")
        return None
    _import_wire()
    from .publisher import Publisher
    from .tracker import TierMedium, Tracker

    tiers = cache.store.tiers
    tracker = Tracker(
        [TierMedium(*medium_of(t)) for t in tiers],
        s.kv_events_block_size,
        cache.parts.writer.chunk_size,
        s.kv_events_chunks,
    )
    publisher = Publisher(
        tracker,
        s.kv_events,
        s.kv_events_replay,
        s.kv_events_topic,
        buffer_steps=s.kv_events_buffer,
        queue_size=s.kv_events_queue,
    )
    events = KVEvents(publisher)
    for i, tier in enumerate(tiers):
        tier.observer = events.observer(i)
    cache.parts.writer.events = events
    log.info("KV events: publishing on %s (topic %r)", publisher.endpoint, s.kv_events_topic)
    disk = [i for i, t in enumerate(tiers) if medium_of(t)[0] == "DISK"]
    if disk:
        from .startup import StartupAnnouncer

        i = disk[0]
        events.startup = StartupAnnouncer(
            events, tiers[i], i, s.kv_events_chunks, cache.store.signer
        )
    return events


def detach(events: KVEvents, engine) -> None:
    """Unhook ``events`` from ``engine`` (before closing it): nothing is offered any more."""
    cache = engine.cache
    for tier in cache.store.tiers:
        tier.observer = None
    cache.parts.writer.events = None
