"""Executing a plan into a live KV cache: one loop, whatever the source of the KV.

``execute`` runs a plan's loads and computes in slot order: each step only needs the slots
before it, and a compute replaces what a load put in its slots. Where a load's KV comes from is
its ``KVSource``'s business:

- ``KVSource`` itself: entries in hand (read before the loop by ``fetch.fetch_entries``), decoded
  as their loads come up;
- ``kv_stream_reader.StreamedSource``: chunks in slow tiers read by a reader thread at the
  encoding the KV budget allows, or recomputed from their tokens (the source says which);
- with ``blend``, the plan's documents (or found spans) and everything after the first of them
  are one step: their KV is written layer by layer (``blend.LayerLoader``: in-hand entries, or
  layer ranges read from their tier) while ``blend.blend_prefill`` computes the slots between
  and after them and recomputes the tokens it selects.

A load whose entry turns out unusable raises ``LoadFailed`` (its entry already removed and
counted where that applies): the caller plans around it and executes again. The result,
``Filled``, carries what the engine counts afterwards: timings, the tier that served each load,
the loads recomputed instead, the KV stream's report, the blend's statistics, and the entries
read from below memory to promote into it once the first token is out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvfuse.blend import (
    BlendOptions,
    BlendStats,
    DocumentLoad,
    LayerLoader,
    LayerLoadFailed,
    blend_prefill,
)
from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, FormatError
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.store import TieredStore

from .fetch import entry_spec
from .kv_stream import KVStreamReport
from .planner import BLENDED, Compute, Load, Plan


class LoadFailed(Exception):
    """A load's entry could not be used (it does not decode, or a document's layer could not be
    read): plan around ``key`` and execute again."""

    def __init__(self, key: ChunkKey, why: str):
        super().__init__(f"entry {key} is unusable ({why})")
        self.key = key


class Promotions:
    """Entries read from a tier below memory while the plan ran, for the memory tier: ready
    entries (a KV stream's, in the encoding they were read in), and those a blend's layer loader
    rebuilds from the layers it read (encoded when asked, after the first token)."""

    def __init__(
        self, ready: list[tuple[ChunkKey, Entry]] | None = None, loader: LayerLoader | None = None
    ):
        self.ready = ready if ready is not None else []
        self.loader = loader

    def entries(self, codec: Codec) -> list[tuple[ChunkKey, Entry]]:
        return self.ready + (self.loader.promotions(codec) if self.loader is not None else [])


@dataclass(kw_only=True, eq=False)
class Filled:
    """What executing a plan produced."""

    # of the prompt's last token (None while ``rest`` is to compute)
    logits: torch.Tensor | None = None
    # slots [start, end) left to compute (``execute(defer_last=True)``)
    rest: tuple[int, int] | None = None
    load_s: float = 0.0
    compute_s: float = 0.0
    # the tier that served each loaded key
    served: dict[ChunkKey, str] = field(default_factory=dict)
    # loads computed instead (a KV stream's)
    recomputed_loads: list[Load] = field(default_factory=list)
    kv_stream: KVStreamReport | None = None
    blend: BlendStats | None = None
    promotions: Promotions = field(default_factory=Promotions)

    @property
    def recomputed_positions(self) -> torch.Tensor:
        """The document slots a blend recomputed in context (none without a blend)."""
        return (
            self.blend.recomputed if self.blend is not None else torch.zeros(0, dtype=torch.int64)
        )


class KVSource:
    """Where the loads' KV comes from: here, entries in hand (``entries``, served by ``served``).

    ``load`` writes a load's KV into the cache and says True, or says False when the executor
    must compute those slots instead; ``computed`` hears of every compute (a source that plans
    by the compute speed measures it); ``finish`` adds what the source knows to the result."""

    def __init__(
        self, entries: dict[ChunkKey, Entry], served: dict[ChunkKey, str], store: TieredStore | None
    ):
        self.entries, self.served, self.store = entries, served, store

    def load(self, runner: Transformer, kv: KVCache, step: Load) -> bool:
        entry = self.entries[step.key]
        try:
            data = entry.decode()
        except FormatError as e:  # intact bytes its codec rejects: a miss, never used
            self.store.discard(step.key)
            raise LoadFailed(step.key, f"does not decode: {e}") from None
        write_load(runner, kv, step, data, entry.positions)
        return True

    def computed(self, tokens: int, seconds: float) -> None:
        pass

    def finish(self, filled: Filled) -> None:
        filled.served.update(self.served)

    def close(self) -> None:
        pass


def write_load(
    runner: Transformer, kv: KVCache, step: Load, data: torch.Tensor, positions: torch.Tensor
) -> None:
    """Put tokens ``offset..`` of a decoded entry (its KV ``data`` stored at ``positions``) into
    slots ``[start, end)`` and move their keys from where they were stored to ``start..``."""
    a, b = step.offset, step.offset + step.end - step.start
    if (a, b) != (0, data.shape[2]):
        data, positions = data[:, :, a:b], positions[a:b]
    kv.write(step.start, data, positions)
    if step.moved:
        runner.move_keys(kv, step.start, step.end, step.start)


@dataclass(frozen=True)
class BlendRun:
    """What the blend step needs: the options, and the store and KV dtype its layer loader reads
    documents below memory with."""

    options: BlendOptions
    store: TieredStore | None
    kv_dtype: torch.dtype


def execute(
    runner: Transformer,
    kv: KVCache,
    ids: list[int],
    plan: Plan,
    source: KVSource,
    *,
    defer_last: bool = False,
    blend: BlendRun | None = None,
) -> Filled:
    """Fill ``kv`` for the prompt ``ids`` as ``plan`` says (see the module docstring); the logits
    of its last token come from the plan's last compute. With ``defer_last`` that compute (which
    always ends the prompt) is left undone and returned as ``rest``: the engine computes it in
    chunks, batched with other sequences' steps (chunked prefill)."""
    run = _Run(runner, kv, ids, source, plan.computes[-1] if plan.computes else None)
    region = _document_region(plan) if blend is not None else None
    try:
        for step in plan.in_order():
            if region is not None and step.start >= region:
                run.blend(plan, region, blend)
                break
            if defer_last and step is run.last:
                run.filled.rest = (step.start, step.end)
                break
            if isinstance(step, Load):
                run.load(step)
            else:
                run.compute(step.start, step.end, step is run.last)
    finally:
        source.close()
    if run.filled.logits is None and run.filled.rest is None:
        raise RuntimeError("a plan must compute at least the prompt's last token")
    source.finish(run.filled)
    return run.filled


def _document_region(plan: Plan) -> int:
    """Where a blended plan's documents (or found spans) start: the blend computes the rest."""
    return min(s.start for s in plan.loads if s.key.kind in BLENDED)


def load_shift(load: Load, entry: Entry | None) -> int:
    """How far a blended load's keys move: from where its entry was stored to its slots (a found
    span's entry, ``source`` None, says where; it is in hand, read whole before the blend)."""
    if load.source is not None:
        return load.start - load.source
    if entry is None:
        raise RuntimeError(f"found span {load.key} must be read before the blend")
    return load.start - int(entry.positions[0])


class _Run:
    """One execution's state: the target cache, the source, and the result being filled."""

    def __init__(
        self,
        runner: Transformer,
        kv: KVCache,
        ids: list[int],
        source: KVSource,
        last: Compute | None,
    ):
        self.runner, self.kv, self.ids, self.source, self.last = runner, kv, ids, source, last
        self.filled = Filled()

    def load(self, step: Load) -> None:
        t = time.perf_counter()
        if self.source.load(self.runner, self.kv, step):
            self.filled.load_s += time.perf_counter() - t
        else:
            self.filled.recomputed_loads.append(step)
            self.compute(step.start, step.end, False)

    def compute(self, start: int, end: int, want_logits: bool) -> None:
        t = time.perf_counter()
        out = self.runner.forward(
            self.ids[start:end],
            self.kv,
            positions=torch.arange(start, end),
            logits="last" if want_logits else "none",
            start=start,
        )
        dt = time.perf_counter() - t
        self.filled.compute_s += dt
        self.source.computed(end - start, dt)
        if want_logits:
            self.filled.logits = out

    def blend(self, plan: Plan, region: int, run: BlendRun) -> None:
        """The documents or found spans (from ``region``), the slots between them and the suffix:
        KV loaded layer by layer, blended."""
        kv, ids, n = self.kv, self.ids, len(self.ids)
        docs = [s for s in plan.in_order() if isinstance(s, Load) and s.key.kind in BLENDED]
        fresh = [c for c in plan.computes if c.end > region]  # between the spans, and the suffix
        suffix = fresh[-1]
        kv.reserve(n)
        # the slots' positions, set once
        kv.positions[region:n] = torch.arange(region, n, device=kv.device)
        for c in fresh:
            # not computed yet: never garbage under an attention mask
            kv.kv[:, :, :, c.start : c.end] = 0
        kv.length = n
        loads = [
            DocumentLoad(
                d.key,
                d.start,
                d.end,
                shift=load_shift(d, self.source.entries.get(d.key)),
                entry=self.source.entries.get(d.key),
                spec=entry_spec(self.runner, run.kv_dtype, d, ids),
            )
            for d in docs
        ]
        loader = LayerLoader(self.runner, kv, loads, run.store).start()
        waited = 0.0

        def ready(layer: int) -> None:
            nonlocal waited
            t0 = time.perf_counter()
            loader.wait(layer)
            waited += time.perf_counter() - t0

        t = time.perf_counter()
        try:
            logits, stats = blend_prefill(
                self.runner,
                kv,
                ids,
                region,
                suffix.start,
                [(d.start, d.end) for d in docs],
                run.options,
                ready,
                fresh=[(c.start, c.end) for c in fresh[:-1]],
            )
        except LayerLoadFailed as e:
            raise LoadFailed(e.key, "a layer could not be read") from None
        finally:
            loader.close()
        f = self.filled
        f.compute_s += time.perf_counter() - t - waited
        f.load_s += waited
        f.logits, f.blend, f.promotions = logits, stats, Promotions(loader=loader)
        f.served.update({d.key: d.tier for d in loader.docs if d.tier is not None})
