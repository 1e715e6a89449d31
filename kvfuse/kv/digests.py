"""The per-layer payload digests of signed entries: which algorithms, and hashing many layers fast.

Why a digest per layer: a signed header holds one digest of each layer's payload bytes, and its
HMAC tag covers them (``kv/signing.py``, ``kv/format.py``), so a reader of one layer range checks
only those layers. The digests are what a signed read or write spends its time on: every payload
byte is hashed once.

Algorithms, by the id a signed header records (inside what its tag covers):

- ``SHA256`` (0): entries signed before digest ids existed. Their header has no id (the format
  flag for it is clear); they are still read, never written.
- ``BLAKE3`` (1): every entry signed now. On the 2-core development VM, one thread hashes ~3.5-4
  GB/s with BLAKE3 against ~1.5 GB/s with SHA-256 (SHA extensions); xxh3 runs at ~30 GB/s. A
  cryptographic hash (collision resistant) is needed: the digests stand for the payload under the
  tag.

Concurrency. ``blake3`` and ``hashlib`` release the GIL while they hash, so the layers of one entry
are split into contiguous groups of about equal bytes, one per core (at most ``MAX_THREADS``):
the calling thread hashes the first group while a small shared pool hashes the others, and a
group no pool thread has started yet is taken back and hashed by the caller (no waiting behind
another caller's work). This is what uses both cores for a 256-token SmolLM2 chunk (30 layers of
~197 KB), where BLAKE3's own threads do not help (below ~384 KiB they cost up to 2x). A reader of
a stream (``kv/format.py``'s ``read_entry``) starts each piece's digests on the pool (``Pending``)
as soon as the piece is read and reads on meanwhile; ``gather`` then hashes in the calling thread
whatever no pool thread has started. A layer of at least ``AUTO_MIN_BYTES`` hashed on its own
(fewer layers than cores, e.g. a one-layer read of a long entry) uses BLAKE3's own threads instead
(``max_threads=AUTO``: ~1.8x at 1-64 MiB on an idle 2-core VM, at most ~10% slower than one
thread when the other core is busy). Inputs below ``SPLIT_MIN_BYTES`` in all are hashed in the
calling thread: a hand-off to the pool would cost more than it saves.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import blake3

from kvfuse.threads import helper_pool

SHA256 = 0  # entries signed before digest ids: no id in the header
BLAKE3 = 1
NAMES = {SHA256: "sha256", BLAKE3: "blake3"}
DIGEST_SIZE = 32  # bytes of one layer's digest, for every algorithm
AUTO_MIN_BYTES = 1 << 20  # a layer hashed alone with at least this many bytes: BLAKE3's own threads
SPLIT_MIN_BYTES = 512 << 10  # layers of at least this many bytes in all: split over the cores
MAX_THREADS = 4


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def _blake3(data) -> bytes:
    return blake3.blake3(data).digest()


def _blake3_threaded(data) -> bytes:
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()


def layer_digest(data, algorithm: int = BLAKE3) -> bytes:
    """The digest of one layer's payload bytes (any buffer) with ``algorithm`` (an id above)."""
    if algorithm == BLAKE3 and _forked is False and memoryview(data).nbytes >= AUTO_MIN_BYTES:
        return _blake3_threaded(data)
    return _hasher(algorithm)(data)


def layer_digests(layers: Sequence, algorithm: int = BLAKE3) -> list[bytes]:
    """``layer_digest`` of each of ``layers`` (buffers), in order, hashed concurrently where that
    pays (see the module docstring)."""
    one = _hasher(algorithm)  # a ValueError for an unknown id, layers or not
    sizes = [memoryview(v).nbytes for v in layers]
    groups = _groups(sizes, _threads())
    if len(groups) < 2 or sum(sizes) < SPLIT_MIN_BYTES:
        return [layer_digest(v, algorithm) for v in layers]
    pending = [Pending(layers[start:stop], algorithm) for start, stop in groups[1:]]
    return _hash_all(one, layers[groups[0][0] : groups[0][1]]) + gather(pending)


class Pending:
    """The digests of some layers, started on the shared pool (a pool thread hashes them unless
    ``take`` hashes them here first). A started ``Pending`` must be gathered: its layers' memory
    must stay valid and unchanged until then."""

    __slots__ = ("_fn", "_layers", "_job")

    def __init__(self, layers: Sequence, algorithm: int = BLAKE3) -> None:
        self._fn, self._layers = _hasher(algorithm), layers
        self._job = _executor().submit(_hash_all, self._fn, layers)

    def take(self) -> list[bytes] | None:
        """The digests hashed in the calling thread, if no pool thread had started them; else None."""
        return _hash_all(self._fn, self._layers) if self._job.cancel() else None

    def result(self) -> list[bytes]:
        got = self.take()
        return self._job.result() if got is None else got


def gather(pending: Sequence[Pending]) -> list[bytes]:
    """The digests of every one of ``pending``, in order. Those no pool thread started are hashed
    here, from the last one back (the pool takes them from the first: the queue is FIFO); then the
    started ones are awaited."""
    taken: dict[int, list[bytes]] = {}
    for k in reversed(range(len(pending))):
        got = pending[k].take()
        if got is None:
            break
        taken[k] = got
    out: list[bytes] = []
    for k, p in enumerate(pending):
        out += taken[k] if k in taken else p.result()
    return out


def _hasher(algorithm: int) -> Callable[[object], bytes]:
    """One thread's digest function of ``algorithm`` (BLAKE3's own threads are not used here)."""
    if algorithm == BLAKE3:
        return _blake3
    if algorithm == SHA256:
        return _sha256
    raise ValueError(f"unknown digest algorithm id {algorithm}")


def _hash_all(fn: Callable[[object], bytes], layers: Sequence) -> list[bytes]:
    return [fn(v) for v in layers]


def _groups(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges splitting ``sizes`` into at most ``n`` contiguous, non-empty
    groups of about equal total size."""
    n = max(1, min(n, len(sizes)))
    total, cuts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        k = len(cuts) + 1  # the cut this would be
        if k < n and (acc * n >= total * k or len(sizes) - i - 1 == n - k):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(sizes)]
    return list(zip(bounds, bounds[1:]))


# -- the shared pool: created on first use, forgotten in a forked child (its threads are not there).
# A forked child does not use BLAKE3's own threads either: they are Rayon's, which a fork leaves
# behind (a child using a pool its parent started would wait for them forever).

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_forked = False


def concurrent() -> bool:
    """Whether hashing on the pool can run beside the calling thread (more than one core)."""
    return _threads() > 1


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = helper_pool(max(1, _threads() - 1), "kvfuse-digest")
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock, _forked
    _pool, _pool_lock, _forked = None, threading.Lock(), True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
