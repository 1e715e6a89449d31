"""Carrying out a plan whose chunks lie in slow tiers within a time budget (CacheGen's streaming).

``stream_prefill`` is ``executor.prefill`` with one difference: the loads from a tier below memory
(prefix, history and tail chunks; documents are blended layer by layer instead) are read one by
one by a reader thread, each at the encoding ``streaming.choose`` picks when its read starts, while
the request's thread decodes and writes the previous one, or recomputes it from its tokens when no
encoding fits (the text fallback). Reads (disk I/O, the network, a throttled link's wait) thus
overlap decoding and recomputation, as CacheGen pipelines transfer and decoding.

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
from kvfuse.tiers.store import TieredStore

from .executor import Prefilled, entry_spec, load, load_decoded, streamed
from .planner import Compute, Load, Plan
from .streaming import RECOMPUTE, SAFETY, LoadEstimates, StreamReport, choose

log = logging.getLogger(__name__)


@dataclass
class Streamed(Prefilled):
    report: StreamReport
    served: dict[ChunkKey, str]  # the tier of each chunk streamed from one (not the recomputed)
    recomputed: list[Load]  # loads computed instead (no encoding fit the budget, or the read failed)
    promotions: list[tuple[ChunkKey, Entry]]  # the streamed entries, for the memory tier



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

    def __init__(self, slow: list[Load], store: TieredStore, runner: Transformer, kv_dtype: torch.dtype,
                 estimates: LoadEstimates, report: StreamReport, t_start: float, ids: list[int]):
        super().__init__(name="kvfuse-stream-reader", daemon=True)
        self.slow, self.store, self.runner, self.kv_dtype, self.ids = slow, store, runner, kv_dtype, ids
        self.estimates, self.report, self.t_start = estimates, report, t_start
        c = runner.config
        self.per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim
        self.raw_bytes = torch.empty((), dtype=kv_dtype).element_size()
        self.results: list[queue.Queue] = [queue.Queue() for _ in slow]  # one result each, as it is read
        self.stop = threading.Event()
        self.busy_until = t_start  # when the request's thread should be done with what it was handed

    def run(self) -> None:
        seen: dict[ChunkKey, _Read] = {}
        for i, step in enumerate(self.slow):
            if self.stop.is_set():
                return
            try:
                got = seen.get(step.key)
                if got is not None and got.entry is not None:  # read for another span: check this one's ids
                    try:
                        entry_spec(self.runner, self.kv_dtype, step, self.ids).check(got.entry)
                    except FormatError as e:
                        log.warning("stream reader: %s for another span (%s); the chunk is recomputed", step.key, e)
                        got = _Read(None)
                got = got or self._read(step, len(self.slow) - i)
            except Exception:  # a bug must not hang the request: recompute the chunk
                log.exception("the stream reader failed on %s; the chunk is recomputed", step.key)
                got = _Read(None)
            if got.entry is not None:
                seen[step.key] = got
            self.results[i].put(got)

    def _read(self, step: Load, chunks_left: int) -> _Read:
        values = step.stored_tokens * self.per_token
        primary = self.store.codecs.get(step.tier)
        primary_name = _encoding_of(primary)
        encodings = [primary_name] + [e for e in self.store.encodings(step.tier) if e != primary_name]
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
        got = self.store.fetch_encoded(step.key, step.tier, variant,
                                       entry_spec(self.runner, self.kv_dtype, step, self.ids))
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


def stream_prefill(runner: Transformer, kv: KVCache, ids: list[int], plan: Plan, entries: dict[ChunkKey, Entry],
                   store: TieredStore, kv_dtype: torch.dtype, slo_s: float, estimates: LoadEstimates) -> Streamed:
    """Fill ``kv`` for a plain prompt within ``slo_s`` seconds of loading (see the module
    docstring); entries in hand (``entries``: the memory tier's) load as usual."""
    steps = plan.in_order()
    slow = [s for s in steps if isinstance(s, Load) and s.key not in entries and streamed(store, s)]
    report = StreamReport(slo_s)
    t_start = time.perf_counter()
    reader = _Reader(slow, store, runner, kv_dtype, estimates, report, t_start, ids)
    reader.start()
    logits, load_s, compute_s = None, 0.0, 0.0
    last = plan.computes[-1] if plan.computes else None
    served: dict[ChunkKey, str] = {}
    recomputed: list[Load] = []
    decoded: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor]] = {}
    promotions: list[tuple[ChunkKey, Entry]] = []
    per_token = reader.per_token

    def compute(start: int, end: int, want_logits: bool):
        nonlocal compute_s
        t = time.perf_counter()
        out = runner.forward(ids[start:end], kv, positions=torch.arange(start, end),
                             logits="last" if want_logits else "none", start=start)
        dt = time.perf_counter() - t
        compute_s += dt
        estimates.computed(end - start, dt)
        return out

    try:
        done = 0
        for step in steps:
            if isinstance(step, Compute):
                out = compute(step.start, step.end, step is last)
                logits = out if step is last else logits
                continue
            t = time.perf_counter()
            if not (done < len(slow) and step is slow[done]):
                load(runner, kv, step, entries[step.key])
                load_s += time.perf_counter() - t
                continue
            got: _Read = reader.results[done].get()
            done += 1
            data = decoded.get(step.key)
            if data is None and got.entry is not None:
                try:
                    data = (got.entry.decode(), got.entry.positions)
                except FormatError:  # intact bytes its codec rejects: never used
                    store.discard(step.key.encoded_as(*got.variant.rsplit(".", 1)) if got.variant else step.key)
                else:
                    estimates.decoded(got.encoding, step.stored_tokens * per_token, time.perf_counter() - t)
                    decoded[step.key] = data
                    promotions.append((step.key, _as_key(got.entry, step.key)))
            if data is None:
                recomputed.append(step)
                report.add(RECOMPUTE)
                compute(step.start, step.end, False)
            else:
                load_decoded(runner, kv, step, *data)
                served[step.key] = step.tier
                report.add(got.encoding)
                load_s += time.perf_counter() - t
            if done == len(slow):
                report.load_s = time.perf_counter() - t_start
    finally:
        reader.stop.set()  # the request failed or is done: read nothing more
    if logits is None:
        raise RuntimeError("a plan must compute at least the prompt's last token")
    return Streamed(logits, load_s, compute_s, report, served, recomputed, promotions)


def _as_key(entry: Entry, key: ChunkKey) -> Entry:
    """``entry`` under ``key`` (a variant's payload, kept as the chunk's copy in memory)."""
    if entry.key == str(key):
        return entry
    return Entry(str(key), entry.codec, entry.shape, entry.dtype, entry.positions, entry.payload, entry.layer_sizes,
                 token_ids=entry.token_ids)
