"""Carrying out a plan on the model runner and the store: fetch, precompute, load, compute, store.

Each function does one kind of plan step and nothing the plan does not ask for; the engine calls
them in order for a sequence being prefilled. Entries are fetched through the store's one
validation path with an ``EntrySpec`` per load (dtype, layout, tokens, stored positions, and the
token ids the load puts in its slots), so an entry that is not exactly what the plan expects is a
miss, planned around by ``replan``. Every entry written records the token ids of its KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvfuse.blend import BlendOptions, BlendStats, DocumentLoad, LayerLoader, blend_prefill
from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, EntrySpec, FormatError, encode_entry
from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.tiers.store import TieredStore

from .planner import Compute, Load, Plan, Precompute, Store


@dataclass
class Fetch:
    """The entries a plan's loads got from the store."""

    entries: dict[ChunkKey, Entry]
    served: dict[ChunkKey, str]  # the tier that served each entry
    unusable: set[ChunkKey]  # found by lookup, but missing or damaged when read
    rejected: int  # damaged copies removed on the way (some were replaced by a slower tier's copy)


def entry_spec(runner: Transformer, kv_dtype: torch.dtype, load: Load, ids) -> EntrySpec:
    """What ``load``'s entry must be for a prompt of token ids ``ids``: the engine's KV dtype and
    layout, its size and stored positions, and, from the entry's token ``load.offset`` on, the ids
    of the slots it fills (a stored history's ids are the running prompt's wherever it is loaded)."""
    c = runner.config
    return EntrySpec(kv_dtype, c.num_layers, c.num_kv_heads, c.head_dim, tokens=load.stored_tokens,
                     first_position=load.source, token_ids=tuple(ids[load.start : load.end]),
                     token_offset=load.offset)


def layer_by_layer(store: TieredStore, load: Load) -> bool:
    """Whether a blend reads this load's entry one layer at a time while it computes (a document
    in a tier below memory) instead of fetching it whole first."""
    return load.key.kind is ChunkKind.DOCUMENT and load.tier is not None and load.tier != store.tiers[0].name


class EntryUnusable(Exception):
    """An entry passed the store's checks but its codec cannot decode it (a miss: plan around it)."""

    def __init__(self, key: ChunkKey, why: str):
        super().__init__(f"entry {key} does not decode ({why})")
        self.key = key


def streamed(store: TieredStore, load: Load) -> bool:
    """Whether the streaming loader reads this load's entry (a prefix, history or tail chunk in a
    tier below memory) chunk by chunk, at the encoding the bandwidth allows."""
    return load.key.kind is not ChunkKind.DOCUMENT and load.tier is not None and load.tier != store.tiers[0].name


def fetch(store: TieredStore, runner: Transformer, kv_dtype: torch.dtype, plan: Plan, ids, pipelined: bool = False,
          streaming: bool = False) -> Fetch:
    """Read every entry the plan for the prompt ``ids`` loads from a tier (each distinct key once,
    checked against the first load of it); with ``pipelined``,
    not the documents a blend will read layer by layer; with ``streaming``, not the chunks the
    streaming loader reads (``stream_prefill``)."""
    wanted: dict[ChunkKey, Load] = {}
    for load in plan.loads:
        if load.tier is not None and not (pipelined and layer_by_layer(store, load)) and not (
                streaming and streamed(store, load)):
            wanted.setdefault(load.key, load)
    keys = list(wanted)
    got = store.fetch(keys, [entry_spec(runner, kv_dtype, wanted[k], ids) for k in keys]) if keys else []
    out = Fetch({}, {}, set(), 0)
    for key, f in zip(keys, got):
        out.rejected += f.rejected
        if f.entry is None:
            out.unusable.add(key)
        else:
            out.entries[key], out.served[key] = f.entry, f.tier
    for load in plan.loads:  # a key loaded over several spans (a stored history's): check the others too
        entry = out.entries.get(load.key)
        if entry is not None and load is not wanted[load.key]:
            try:
                entry_spec(runner, kv_dtype, load, ids).check(entry)
            except FormatError:
                store.discard(load.key)
                del out.entries[load.key], out.served[load.key]
                out.unusable.add(load.key)
                out.rejected += 1
    return out


def precompute(runner: Transformer, kv_dtype: torch.dtype, codec: Codec, step: Precompute) -> Entry:
    """A document's KV computed on its own, behind ``step.context``, as an entry of its tokens."""
    ids = list(step.context) + list(step.ids)
    scratch = runner.new_cache(len(ids), dtype=kv_dtype)
    runner.forward(ids, scratch, logits="none")
    return encode_entry(scratch.chunk(len(step.context), len(ids)), step.key, codec, token_ids=step.ids)


def load(runner: Transformer, kv: KVCache, step: Load, entry: Entry) -> None:
    """Put tokens ``offset..`` of ``entry`` into slots ``[start, end)`` and move their keys from
    where they were stored to ``start..``. EntryUnusable if its payload does not decode."""
    try:
        data = entry.decode()
    except FormatError as e:
        raise EntryUnusable(step.key, str(e)) from None
    load_decoded(runner, kv, step, data, entry.positions)


def load_decoded(runner: Transformer, kv: KVCache, step: Load, data: torch.Tensor, positions: torch.Tensor) -> None:
    """``load`` of an entry already decoded to ``data`` (its KV) and ``positions``."""
    a, b = step.offset, step.offset + step.end - step.start
    if (a, b) != (0, data.shape[2]):
        data, positions = data[:, :, a:b], positions[a:b]
    kv.write(step.start, data, positions)
    if step.moved:
        runner.move_keys(kv, step.start, step.end, step.start)


@dataclass
class Prefilled:
    logits: torch.Tensor | None  # of the prompt's last token (None while ``rest`` is still to compute)
    load_s: float
    compute_s: float
    rest: tuple[int, int] | None = field(default=None, kw_only=True)  # slots [start, end) left to compute (``prefill(defer_last=True)``)


def prefill(runner: Transformer, kv: KVCache, ids: list[int], plan: Plan, entries: dict[ChunkKey, Entry],
            defer_last: bool = False) -> Prefilled:
    """Fill ``kv`` for the whole prompt: the plan's loads and computes in slot order (a compute
    only needs the slots before it), the logits of the last token from the last compute.

    With ``defer_last`` the last compute (which always ends the prompt) is left undone and
    returned as ``rest``: the engine computes it in chunks, batched with other sequences' steps
    (chunked prefill)."""
    logits, load_s, compute_s = None, 0.0, 0.0
    last = plan.computes[-1] if plan.computes else None
    for step in plan.in_order():
        if defer_last and step is last:
            return Prefilled(None, load_s, compute_s, rest=(step.start, step.end))
        t = time.perf_counter()
        if isinstance(step, Load):
            load(runner, kv, step, entries[step.key])
            load_s += time.perf_counter() - t
        else:
            out = runner.forward(ids[step.start : step.end], kv, positions=torch.arange(step.start, step.end),
                                 logits="last" if step is last else "none", start=step.start)
            logits = out if step is last else logits
            compute_s += time.perf_counter() - t
    if logits is None:
        raise RuntimeError("a plan must compute at least the prompt's last token")
    return Prefilled(logits, load_s, compute_s)


@dataclass
class Blended(Prefilled):
    stats: BlendStats
    loader: LayerLoader
    recomputed_positions: torch.Tensor


def prefill_blended(runner: Transformer, kv: KVCache, ids: list[int], plan: Plan, entries: dict[ChunkKey, Entry],
                    store: TieredStore, kv_dtype: torch.dtype, options: BlendOptions) -> Blended:
    """Fill ``kv`` for a prompt with documents: the steps before the documents in slot order, then
    the blend over the documents and the suffix, the documents' KV arriving layer by layer from a
    ``LayerLoader`` (entries in hand, or read from their tier). ``LayerLoadFailed`` if a document
    cannot be read; the caller replans around it."""
    steps = plan.in_order()
    docs = [s for s in steps if isinstance(s, Load) and s.key.kind is ChunkKind.DOCUMENT]
    region, suffix = docs[0].start, plan.computes[-1]
    if any(isinstance(s, Compute) and s.start >= region and s is not suffix for s in steps):
        raise RuntimeError("a blended plan computes nothing between its documents")
    load_s = compute_s = 0.0
    for step in steps:  # the prefix: loads and computes before the documents
        if step.start >= region:
            break
        t = time.perf_counter()
        if isinstance(step, Load):
            load(runner, kv, step, entries[step.key])
            load_s += time.perf_counter() - t
        else:
            runner.forward(ids[step.start : step.end], kv, positions=torch.arange(step.start, step.end), logits="none",
                           start=step.start)
            compute_s += time.perf_counter() - t
    n = len(ids)
    kv.reserve(n)
    kv.positions[region:n] = torch.arange(region, n, device=kv.device)  # the slots' positions, set once
    kv.kv[:, :, :, suffix.start : n] = 0  # not computed yet: never garbage under an attention mask
    kv.length = n
    loads = [DocumentLoad(d.key, d.start, d.end, shift=d.start - d.source, entry=entries.get(d.key),
                          spec=entry_spec(runner, kv_dtype, d, ids)) for d in docs]
    loader = LayerLoader(runner, kv, loads, store).start()
    waited = 0.0

    def ready(layer: int) -> None:
        nonlocal waited
        t0 = time.perf_counter()
        loader.wait(layer)
        waited += time.perf_counter() - t0

    t = time.perf_counter()
    try:
        logits, stats = blend_prefill(runner, kv, ids, region, suffix.start, [(d.start, d.end) for d in docs], options,
                                      ready)
    finally:
        loader.close()
    compute_s += time.perf_counter() - t - waited
    return Blended(logits, load_s + waited, compute_s, stats, loader, stats.recomputed)


def unheld(store: TieredStore, spans) -> list[Store]:
    """The spans whose keys no tier holds yet (the others need not be written again)."""
    spans = list(spans)
    held = store.lookup([s.key for s in spans], count=False).where
    return [s for s, w in zip(spans, held) if w is None]


def encode_spans(kv: KVCache, codec: Codec, spans, ids) -> list[tuple[ChunkKey, Entry]]:
    """An entry per span of ``kv`` (its slots copied out), keyed by the span's key, recording the
    span's token ids (``ids``: the token id of every slot of ``kv``)."""
    return [(s.key, encode_entry(kv.chunk(s.start, s.end), s.key, codec, token_ids=ids[s.start : s.end]))
            for s in spans if s.end <= kv.length]


def store(store: TieredStore, kv: KVCache, codec: Codec, spans: list[Store] | tuple[Store, ...], ids,
          expires_at: float | None = None, memory_only: bool = False) -> int:
    """Save the KV of each span under its key (memory now, lower tiers in the background), to
    stay until ``expires_at`` (None: the tiers' policy), in memory only if ``memory_only``.
    ``ids``: the token id of every slot of ``kv``."""
    items = encode_spans(kv, codec, spans, ids)
    if items:
        store.put(items, expires_at=expires_at, memory_only=memory_only)
    return len(items)
