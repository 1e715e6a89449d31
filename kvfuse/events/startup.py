"""Announcing, at start-up, the chunks the disk tier already holds (``server.kv_events`` on).

A server that restarts keeps its disk tier, but a router knows of those blocks only from events:
without this, a restarted server's disk entries are invisible to ``kv_aware`` until a request
happens to load them. So, once the publisher runs, a thread of its own (never the request path)
lists the disk tier's most recently used keys (at most ``server.kv_events_chunks``, the tracker's
capacity), reads each entry's header (key, first position, token ids; signed entries checked with
the store's signer), rebuilds the prefix chains (``chains``) and offers each chunk to the
publisher as ``found`` (its blocks computed) and ``stored`` in the disk tier: a ``BlockStored``
with medium ``DISK``, exactly what the server would have sent when it wrote the entry.

An entry records its key and tokens, not its parent's key, and a block hash depends on every token
before it; so a chunk is announced only when its whole chain back to position 0 is on the disk too
(a chain whose start was evicted cannot be matched by a prefix-matching router anyway), each link
checked by recomputing the child's key from the parent's (``kv.keys.follows``). The check costs a
SHA-256 per candidate parent at the position before (entries of the same namespace): bounded by
``MAX_CHECKS`` in all. Before reading, the thread waits (at most ``WAIT_S``) for a subscriber, so
that a router reconnecting to the restarted server gets the batch; without one the batches are
still kept for replay. The reads go through the disk tier (they count as its hits, and touch each
entry: least recent first, so the recency order stays).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfuse.counters import Counters
from kvfuse.kv.format import FormatError, header_length, parse_header
from kvfuse.kv.keys import ChunkKey, ChunkKind, follows

from .blocks import ANNOUNCED

log = logging.getLogger(__name__)

WAIT_S = 10.0  # how long to wait for a first subscriber before announcing anyway
MAX_CHECKS = 200_000  # candidate-parent checks (one SHA-256 each) in one start-up scan at most
HEAD_BYTES = 4096  # the first read of an entry: its header, unless the header says it is longer


@dataclass(frozen=True)
class Found:
    """An entry read at start-up: its key, the position of its first token and its token ids."""

    key: ChunkKey
    start: int
    tokens: tuple[int, ...]


@dataclass
class StartupStats(Counters):
    """``startup_read``: entries whose header was read; ``startup_announced``: chunks offered;
    ``startup_unchained``: entries left out (a link of their chain missing or not checked)."""

    startup_read: int = 0
    startup_announced: int = 0
    startup_unchained: int = 0


def chains(
    found: Sequence[Found], chunk_size: int, max_checks: int = MAX_CHECKS
) -> list[tuple[Found, ChunkKey | None]]:
    """The entries of ``found`` whose chain back to position 0 is in ``found``, each with its
    parent prefix key (None at position 0), parents before children. A candidate parent is a
    prefix entry of the same namespace at the chunk before, kept itself, that ``follows`` checks;
    after ``max_checks`` checks the rest is left out."""
    level: dict[tuple[str, int], list[ChunkKey]] = defaultdict(list)
    out: list[tuple[Found, ChunkKey | None]] = []
    checks = 0
    for f in sorted(found, key=lambda f: f.start):
        if f.key.kind not in ANNOUNCED or f.key.variant or f.start % chunk_size:
            continue
        parent = None
        if f.start:
            for p in level.get((f.key.namespace_id, f.start - chunk_size), ()):
                checks += 1
                if checks > max_checks:
                    return out
                if follows(p, f.key, f.tokens, chunk_size):
                    parent = p
                    break
            if parent is None:
                continue
        out.append((f, parent))
        if f.key.kind is ChunkKind.PREFIX and len(f.tokens) == chunk_size:
            level[(f.key.namespace_id, f.start)].append(f.key)
    return out


def read_found(tier, key: ChunkKey, signer=None) -> Found | None:
    """``key``'s entry in ``tier`` as ``Found`` (None: gone, not an entry, no token ids, another
    key in its header, or a signature that does not check)."""
    head = tier.read_range(key, 0, HEAD_BYTES)
    if head is None:
        return None
    try:
        n = header_length(head)
        if n > len(head):
            head = tier.read_range(key, 0, n)
            if head is None:
                return None
        h = parse_header(head[:n], signer)
    except FormatError:
        return None
    if h.key != str(key) or h.token_ids is None or len(h.positions) == 0:
        return None
    return Found(key, int(h.positions[0]), tuple(h.token_ids.tolist()))


class StartupAnnouncer:
    """The start-up scan's thread (see the module docstring); ``stop`` ends it early."""

    def __init__(self, events, tier, tier_index: int, limit: int, signer=None) -> None:
        self.events, self.tier, self.tier_index = events, tier, tier_index
        self.limit, self.signer = limit, signer
        self.stats = StartupStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfuse-kv-startup", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the scan to finish; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._wait_for_subscriber()
            if not self._stop.is_set():
                self._announce()
        except Exception:
            log.exception("KV events: announcing the disk tier's entries failed")

    def _wait_for_subscriber(self) -> None:
        deadline = time.monotonic() + WAIT_S
        stats = self.events.publisher.stats
        while time.monotonic() < deadline and not self._stop.is_set():
            if stats.snapshot().get("subscribers", 0) > 0:
                return
            self._stop.wait(0.05)

    def _announce(self) -> None:
        keys = [k for k in self.tier.keys(self.limit) if k.kind in ANNOUNCED and not k.variant]
        found = []
        for key in reversed(keys):  # least recent first: each first read touches its entry
            if self._stop.is_set():
                return
            f = read_found(self.tier, key, self.signer)
            if f is not None:
                found.append(f)
        chunk_size = self.events.publisher.tracker.chunk_size
        chained = chains(found, chunk_size)
        self.stats.add(startup_read=len(found), startup_unchained=len(found) - len(chained))
        for f, parent in chained:
            if self._stop.is_set():
                return
            self._offer(("found", f.key, parent, f.tokens))
            self._offer(("stored", self.tier_index, f.key))
            self.stats.add(startup_announced=1)
        log.info("KV events: announced %d chunks found on the disk tier", len(chained))

    def _offer(self, item: tuple) -> None:
        """Offer without flooding the inbox: the request path's notifications share it."""
        inbox = self.events.publisher.inbox
        while len(inbox) * 2 > inbox.capacity and not self._stop.is_set():
            self._stop.wait(0.01)
        self.events.publisher.offer(item)
