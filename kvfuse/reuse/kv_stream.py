"""The KV stream (CacheGen's bandwidth-adaptive loading): per chunk, the best encoding that still
meets the KV budget, or recomputing the chunk from its tokens when none does. Pure rules and
measurements; "kv stream" names this and nothing else in kvfuse (a server's ``stream`` is
server-sent events, a tokenizer's is ``IncrementalDecoder``).

A prompt whose chunks lie in a slow tier (disk, Redis, a throttled link) is loaded chunk by chunk
(``kv_stream_reader.StreamedSource``, the plan executor's source): a reader thread reads chunk
after chunk while the request's thread decodes them into the live KV, or recomputes the ones
chosen for recomputation. Before
each read, :func:`choose` (pure, table-tested) picks among that chunk's encodings in the tier
(its primary copy, plus the CacheGen levels stored as variants) and recomputation, given the time
left in the budget (``kv_slo_ms``), the slow chunks still to load, the request thread's backlog,
and per-option estimates (read: bytes over the measured bandwidth; decode; recompute):

- the highest-quality encoding that would finish in time were every remaining chunk loaded at
  it (CacheGen's rule: plan as if the rest goes at the same level), reads overlapping decodes;
- when none would: the option that gets *this* chunk into the KV soonest, recomputation
  included (CacheGen's text fallback). Reads and recomputations then proceed side by side: a
  slow link is shared with the CPU rather than waited on.

A tier not measured yet is read at its smallest encoding first (a cheap measurement, like a
slow start). The loader keeps a margin (``SAFETY``, 10% of the budget) and plans with the lower of
the last and the average throughput: links vary between chunks. :class:`LoadEstimates` keeps what the choice needs, measured as the engine goes:
each tier's throughput (from the last read, as CacheGen uses the previous chunk's), the bytes per
KV value and the decode time per value of each encoding, and the compute time per prompt token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

RECOMPUTE = "recompute"
SAFETY = 0.1  # share of the budget kept in reserve for estimation errors

# Bytes per KV value before anything is measured (CacheGen levels: bench/codec.py on SmolLM2).
_PRIOR_BYTES_PER_VALUE = {
    "cachegen.1": 0.24,
    "cachegen.2": 0.32,
    "cachegen.3": 0.44,
    "cachegen.4": 0.62,
    "int8": 1.03,
}
_PRIOR_DECODE_S_PER_VALUE = {"raw": 0.0, "int8": 2e-9}
_PRIOR_CACHEGEN_DECODE_S = 15e-9
_PRIOR_BANDWIDTH = 1e9  # bytes/s before a tier's first read
_PRIOR_COMPUTE_S_PER_TOKEN = 1e-3
_EWMA = 0.5


def quality(encoding: str) -> int:
    """Rank of an encoding: lossless first, then int8, then CacheGen levels by level."""
    name, _, level = encoding.partition(".")
    if name == "raw":
        return 1000
    if name == "int8":
        return 500
    return int(level) if level.isdigit() else 0


@dataclass(frozen=True)
class Option:
    """One way to load a chunk: an encoding ("raw", "cachegen.2"...), its estimated read and
    decode seconds, and its quality rank."""

    encoding: str
    read_s: float
    decode_s: float
    quality: int

    @property
    def seconds(self) -> float:
        return self.read_s + self.decode_s

    def finish_all(self, n: int, backlog_s: float) -> float:
        """Seconds until ``n`` chunks read at this option are in the KV: reads back to back, each
        decoded after its read and after the work already queued (``backlog_s``)."""
        return max(n * self.read_s, backlog_s + (n - 1) * self.decode_s) + self.decode_s

    def ready(self, backlog_s: float) -> float:
        """Seconds until one chunk read now is in the KV."""
        return max(self.read_s, backlog_s) + self.decode_s


def choose(
    options: Sequence[Option],
    remaining_s: float,
    chunks_left: int,
    recompute_s: float,
    backlog_s: float = 0.0,
) -> str:
    """The encoding to read the next chunk at, or ``RECOMPUTE`` (see the module docstring).
    ``chunks_left`` counts this chunk and the slow chunks after it; ``backlog_s`` is the work the
    request's thread has queued already (decodes, recomputations)."""
    n = max(chunks_left, 1)
    for o in sorted(options, key=lambda o: (-o.quality, o.seconds)):
        if o.finish_all(n, backlog_s) <= remaining_s:
            return o.encoding
    best = min(options, key=lambda o: (o.ready(backlog_s), -o.quality), default=None)
    if best is None or backlog_s + recompute_s < best.ready(backlog_s):
        return RECOMPUTE
    return best.encoding


@dataclass
class LoadEstimates:
    """Measured rates behind the choice; shared by the engine's requests (thread-safe)."""

    bandwidth: dict[str, float] = field(default_factory=dict)  # tier -> bytes/s of the last read
    bandwidth_avg: dict[str, float] = field(default_factory=dict)  # tier -> a moving average
    # encoding -> bytes per KV value
    bytes_per_value: dict[str, float] = field(default_factory=dict)
    decode_s_per_value: dict[str, float] = field(default_factory=dict)
    compute_s_per_token: float = _PRIOR_COMPUTE_S_PER_TOKEN
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def options(
        self, tier: str, encodings: Sequence[str], values: int, raw_bytes_per_value: float
    ) -> list[Option]:
        """The options of a chunk of ``values`` KV values in ``tier`` with these encodings."""
        # Plan with the lower of the last read's throughput and the average: a link that varies
        # costs a few lower levels, not a missed budget.
        bw = min(
            self.bandwidth.get(tier, _PRIOR_BANDWIDTH),
            self.bandwidth_avg.get(tier, _PRIOR_BANDWIDTH),
        )
        out = []
        for enc in encodings:
            per_value = self.bytes_per_value.get(enc) or (
                raw_bytes_per_value
                if enc == "raw"
                else _PRIOR_BYTES_PER_VALUE.get(enc, raw_bytes_per_value)
            )
            decode = self.decode_s_per_value.get(
                enc, _PRIOR_DECODE_S_PER_VALUE.get(enc, _PRIOR_CACHEGEN_DECODE_S)
            )
            out.append(Option(enc, values * per_value / bw, values * decode, quality(enc)))
        return out

    def measured(self, tier: str) -> bool:
        """Whether a read from ``tier`` has been timed yet."""
        return tier in self.bandwidth

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.compute_s_per_token

    def read(self, tier: str, encoding: str, nbytes: int, values: int, read_s: float) -> None:
        """Record one chunk's read: ``nbytes`` for ``values`` KV values in ``read_s`` seconds."""
        with self._lock:
            if read_s > 0 and nbytes > 0:
                self.bandwidth[tier] = nbytes / read_s  # the last chunk's throughput, as CacheGen
                self._mix(self.bandwidth_avg, tier, nbytes / read_s)
            if values > 0:
                self._mix(self.bytes_per_value, encoding, nbytes / values)

    def decoded(self, encoding: str, values: int, seconds: float) -> None:
        """Record one chunk's decode (and write into the live KV)."""
        if values > 0:
            with self._lock:
                self._mix(self.decode_s_per_value, encoding, seconds / values)

    def computed(self, tokens: int, seconds: float) -> None:
        """Record a prefill compute of ``tokens`` tokens that took ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.compute_s_per_token += _EWMA * (seconds / tokens - self.compute_s_per_token)

    @staticmethod
    def _mix(table: dict, key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + _EWMA * (value - old)


@dataclass
class KVStreamReport:
    """How one prompt's slow chunks were loaded."""

    slo_s: float
    chunks: dict[str, int] = field(default_factory=dict)  # encoding (or "recompute") -> chunks
    load_s: float = 0.0  # from the first slow chunk's choice to the last one in the cache
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def met(self) -> bool:
        return self.load_s <= self.slo_s

    def add(self, encoding: str) -> None:
        self.chunks[encoding] = self.chunks.get(encoding, 0) + 1
