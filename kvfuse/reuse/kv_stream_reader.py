"""The KV stream's source: a plan's chunks in slow tiers read within a time budget (CacheGen).

``StreamedSource`` is the plan executor's source for a plain prompt with a KV budget
(``kv_slo_ms``): the loads from a tier below memory (prefix, history and tail chunks; documents
are blended layer by layer instead) are read one by one by a reader thread, each at the encoding
``kv_stream.choose`` picks when its read starts, while the request's thread decodes and writes the
previous one, or recomputes it from its tokens when no encoding fits (the text fallback). Reads
(disk I/O, the network, a throttled link's wait) thus overlap decoding and recomputation, as
CacheGen pipelines transfer and decoding. Loads already in hand (the memory tier's) load as usual.

The streamed entries are then promoted into memory under their chunk's key, in the encoding they
were read in (the header says which), so a repeated prompt is a memory hit.

The reader never touches the live KV: it only reads and checks entries (the store's one
validation path), so the slot order of loads and computes is exactly the plan's. An entry whose
payload turns out not to decode is removed from its tier and its chunk recomputed: a miss, never
used.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, FormatError
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.store import TieredStore

from .fetch import entry_spec, span_fits, streamed
from .kv_stream import RECOMPUTE, SAFETY, KVStreamReport, LoadEstimates, choose
from .plan_executor import Filled, KVSource, Promotions, write_load
from .planner import Load, Plan

log = logging.getLogger(__name__)


@dataclass
class _Read:
    entry: Entry | None  # None: recompute this chunk
    encoding: str = RECOMPUTE
    variant: str = ""


def _encoding_of(codec: Codec | None) -> str:
    """The encoding name of a codec ("raw" for a lossless one, or when a tier keeps entries as put)."""
    return "raw" if codec is None or codec.is_lossless else f"{codec.name}.{codec.level}"


class _Reader(threading.Thread):
    """Reads the slow loads in order, choosing each one's encoding as its read starts."""

    def __init__(
        self,
        slow: list[Load],
        store: TieredStore,
        runner: Transformer,
        kv_dtype: torch.dtype,
        estimates: LoadEstimates,
        report: KVStreamReport,
        t_start: float,
        ids: list[int],
    ):
        super().__init__(name="kvfuse-kv-stream-reader", daemon=True)
        self.slow, self.store, self.runner, self.kv_dtype, self.ids = (
            slow,
            store,
            runner,
            kv_dtype,
            ids,
        )
        self.estimates, self.report, self.t_start = estimates, report, t_start
        c = runner.config
        self.per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim
        self.raw_bytes = torch.empty((), dtype=kv_dtype).element_size()
        # one result each, as it is read
        self.results: list[queue.Queue] = [queue.Queue() for _ in slow]
        self.stop = threading.Event()
        # when the request's thread should be done with what it was handed
        self.busy_until = t_start

    def run(self) -> None:
        seen: dict[ChunkKey, _Read] = {}
        for i, step in enumerate(self.slow):
            if self.stop.is_set():
                return
            try:
                got = seen.get(step.key)
                # read for another span: check this one's ids
                if got is not None and got.entry is not None:
                    why = span_fits(self.runner, self.kv_dtype, step, self.ids, got.entry)
                    if why is not None:
                        log.warning(
                            "KV stream reader: %s for another span (%s); the chunk is recomputed",
                            step.key,
                            why,
                        )
                        got = _Read(None)
                got = got or self._read(step, len(self.slow) - i)
            except Exception:  # a bug must not hang the request: recompute the chunk
                log.exception(
                    "the KV stream reader failed on %s; the chunk is recomputed", step.key
                )
                got = _Read(None)
            if got.entry is not None:
                seen[step.key] = got
            self.results[i].put(got)

    def _read(self, step: Load, chunks_left: int) -> _Read:
        values = step.stored_tokens * self.per_token
        primary = self.store.codecs.get(step.tier)
        primary_name = _encoding_of(primary)
        encodings = [primary_name] + [
            e for e in self.store.encodings(step.tier) if e != primary_name
        ]
        options = self.estimates.options(step.tier, encodings, values, self.raw_bytes)
        now = time.perf_counter()
        remaining = self.report.slo_s * (1 - SAFETY) - (now - self.t_start)
        backlog = max(0.0, self.busy_until - now)
        recompute_s = self.estimates.recompute_s(step.end - step.start)
        if not self.estimates.measured(step.tier):
            choice = min(options, key=lambda o: o.read_s).encoding  # measure the link cheaply first
        else:
            choice = choose(options, remaining, chunks_left, recompute_s, backlog)
        if choice == RECOMPUTE:
            self.busy_until = max(self.busy_until, now) + recompute_s
            return _Read(None)
        variant = "" if choice == primary_name else choice
        got = self.store.fetch_encoded(
            step.key, step.tier, variant, entry_spec(self.runner, self.kv_dtype, step, self.ids)
        )
        done = time.perf_counter()
        if got is None:
            self.busy_until = max(self.busy_until, done) + recompute_s
            return _Read(None)
        encoding = _encoding_of(got.entry.codec)
        self.estimates.read(step.tier, encoding, got.nbytes, values, done - now)
        decode_s = next((o.decode_s for o in options if o.encoding == encoding), 0.0)
        self.busy_until = max(self.busy_until, done) + decode_s
        with self.report.lock:
            self.report.bytes_read += got.nbytes
        return _Read(got.entry, encoding, got.variant)


class StreamedSource(KVSource):
    """Loads in hand as usual; the slow ones from the reader thread (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        entries: dict[ChunkKey, Entry],
        served: dict[ChunkKey, str],
        store: TieredStore,
        runner: Transformer,
        kv_dtype: torch.dtype,
        ids: list[int],
        slo_s: float,
        estimates: LoadEstimates,
    ):
        super().__init__(entries, served, store)
        self.slow = [
            s
            for s in plan.in_order()
            if isinstance(s, Load) and s.key not in entries and streamed(store, s)
        ]
        self.report = KVStreamReport(slo_s)
        self.estimates = estimates
        self.t_start = time.perf_counter()
        self.reader = _Reader(
            self.slow, store, runner, kv_dtype, estimates, self.report, self.t_start, ids
        )
        self.reader.start()
        self.done = 0  # slow loads taken from the reader
        # the tier of each chunk streamed (not the recomputed)
        self.streamed: dict[ChunkKey, str] = {}
        self.decoded: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self.promoted: list[tuple[ChunkKey, Entry]] = []

    def load(self, runner: Transformer, kv: KVCache, step: Load) -> bool:
        if not (self.done < len(self.slow) and step is self.slow[self.done]):
            return super().load(runner, kv, step)
        t = time.perf_counter()
        got: _Read = self.reader.results[self.done].get()
        self.done += 1
        data = self.decoded.get(step.key)
        if data is None and got.entry is not None:
            data = self._decode(step, got, t)
        if data is None:
            self.report.add(RECOMPUTE)
        else:
            write_load(runner, kv, step, *data)
            self.streamed[step.key] = step.tier
            self.report.add(got.encoding)
        if self.done == len(self.slow):
            self.report.load_s = time.perf_counter() - self.t_start
        return data is not None

    def _decode(self, step: Load, got: _Read, t: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The streamed entry's KV and positions, or None (its copy removed) if it does not decode."""
        try:
            data = (got.entry.decode(), got.entry.positions)
        except FormatError:  # intact bytes its codec rejects: never used
            self.store.discard(
                step.key.encoded_as(*got.variant.rsplit(".", 1)) if got.variant else step.key
            )
            return None
        self.estimates.decoded(
            got.encoding, step.stored_tokens * self.reader.per_token, time.perf_counter() - t
        )
        self.decoded[step.key] = data
        self.promoted.append((step.key, _as_key(got.entry, step.key)))
        return data

    def computed(self, tokens: int, seconds: float) -> None:
        self.estimates.computed(tokens, seconds)

    def finish(self, filled: Filled) -> None:
        super().finish(filled)
        filled.served.update(self.streamed)
        filled.kv_stream = self.report
        filled.promotions = Promotions(self.promoted)

    def close(self) -> None:
        self.reader.stop.set()  # the request failed or is done: read nothing more


def _as_key(entry: Entry, key: ChunkKey) -> Entry:
    """``entry`` under ``key`` (a variant's payload, kept as the chunk's copy in memory)."""
    if entry.key == str(key):
        return entry
    return Entry(
        str(key),
        entry.codec,
        entry.shape,
        entry.dtype,
        entry.positions,
        entry.payload,
        entry.layer_sizes,
        token_ids=entry.token_ids,
    )
