"""Carrying out a plan on the model runner and the store: fetch, precompute, load, compute, store.

Each function does one kind of plan step and nothing the plan does not ask for; the engine calls
them in order for a sequence being prefilled. Entries are fetched through the store's one
validation path with an ``EntrySpec`` per load (dtype, layout, tokens, stored positions), so an
entry that is not exactly what the plan expects is a miss, planned around by ``replan``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, EntrySpec, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.tiers.store import TieredStore

from .planner import Load, Plan, Precompute, Store


@dataclass
class Fetch:
    """The entries a plan's loads got from the store."""

    entries: dict[ChunkKey, Entry]
    served: dict[ChunkKey, str]  # the tier that served each entry
    unusable: set[ChunkKey]  # found by lookup, but missing or damaged when read
    rejected: int  # damaged copies removed on the way (some were replaced by a slower tier's copy)


def entry_spec(runner: Transformer, kv_dtype: torch.dtype, load: Load) -> EntrySpec:
    c = runner.config
    return EntrySpec(kv_dtype, c.num_layers, c.num_kv_heads, c.head_dim, tokens=load.end - load.start,
                     first_position=load.source)


def fetch(store: TieredStore, runner: Transformer, kv_dtype: torch.dtype, plan: Plan) -> Fetch:
    """Read every entry the plan loads from a tier (each distinct key once)."""
    wanted: dict[ChunkKey, Load] = {}
    for load in plan.loads:
        if load.tier is not None:
            wanted.setdefault(load.key, load)
    keys = list(wanted)
    got = store.fetch(keys, [entry_spec(runner, kv_dtype, wanted[k]) for k in keys]) if keys else []
    out = Fetch({}, {}, set(), 0)
    for key, f in zip(keys, got):
        out.rejected += f.rejected
        if f.entry is None:
            out.unusable.add(key)
        else:
            out.entries[key], out.served[key] = f.entry, f.tier
    return out


def precompute(runner: Transformer, kv_dtype: torch.dtype, codec: Codec, step: Precompute) -> Entry:
    """A document's KV computed on its own, behind ``step.context``, as an entry of its tokens."""
    ids = list(step.context) + list(step.ids)
    scratch = runner.new_cache(len(ids), dtype=kv_dtype)
    runner.forward(ids, scratch, logits="none")
    return encode_entry(scratch.chunk(len(step.context), len(ids)), step.key, codec)


def load(runner: Transformer, kv: KVCache, step: Load, entry: Entry) -> None:
    """Put ``entry`` into slots ``[start, end)`` and move its keys from ``source`` to ``start``."""
    kv.write(step.start, entry.decode(), entry.positions)
    if step.moved:
        runner.move_keys(kv, step.start, step.end, step.start)


@dataclass
class Prefilled:
    logits: torch.Tensor  # of the prompt's last token
    load_s: float
    compute_s: float


def prefill(runner: Transformer, kv: KVCache, ids: list[int], plan: Plan, entries: dict[ChunkKey, Entry]) -> Prefilled:
    """Fill ``kv`` for the whole prompt: the plan's loads and computes in slot order (a compute
    only needs the slots before it), the logits of the last token from the last compute."""
    logits, load_s, compute_s = None, 0.0, 0.0
    last = plan.computes[-1] if plan.computes else None
    for step in plan.in_order():
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


def store(store: TieredStore, kv: KVCache, codec: Codec, spans: list[Store] | tuple[Store, ...]) -> int:
    """Save the KV of each span under its key (memory now, lower tiers in the background)."""
    items = [(s.key, encode_entry(kv.chunk(s.start, s.end), s.key, codec)) for s in spans if s.end <= kv.length]
    if items:
        store.put(items)
    return len(items)
