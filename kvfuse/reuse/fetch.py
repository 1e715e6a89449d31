"""Reading a plan's entries before it runs, and what every loaded entry must be.

``entry_spec`` says what a load's entry must be (the engine's KV dtype and layout, its size and
stored positions, and the token ids of the slots it fills): the store checks every entry it reads
against it (``kv.format``'s one validation path). ``span_fits`` is the one check of an entry read
for one span against another span of the same key (a stored history's entry loaded over several
runs of slots). ``fetch_entries`` reads, in one batch, every entry the plan loads from a tier,
except those read later while the plan runs (a blend's documents in a slow tier, read layer by
layer; a KV stream's chunks, read one by one at the encoding the budget allows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfuse.kv.format import Entry, EntrySpec, FormatError
from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.models.transformer import Transformer
from kvfuse.store import TieredStore

from .planner import Load, Plan


@dataclass
class FetchedEntries:
    """The entries a plan's loads got from the store before it runs."""

    entries: dict[ChunkKey, Entry] = field(default_factory=dict)
    served: dict[ChunkKey, str] = field(default_factory=dict)  # the tier that served each entry
    # found by lookup, but missing or damaged when read
    unusable: set[ChunkKey] = field(default_factory=set)
    # damaged copies removed on the way (some were replaced by a slower tier's copy)
    rejected: int = 0


def entry_spec(runner: Transformer, kv_dtype: torch.dtype, load: Load, ids) -> EntrySpec:
    """What ``load``'s entry must be for a prompt of token ids ``ids``: the engine's KV dtype and
    layout, its size and stored positions (any contiguous ones for a found span, ``source`` None),
    and, from the entry's token ``load.offset`` on, the ids of the slots it fills (a stored
    history's ids are the running prompt's wherever it is loaded)."""
    c = runner.config
    return EntrySpec(
        kv_dtype,
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        tokens=load.stored_tokens,
        first_position=load.source,
        token_ids=tuple(ids[load.start : load.end]),
        token_offset=load.offset,
        contiguous=load.source is None,
    )


def span_fits(
    runner: Transformer, kv_dtype: torch.dtype, load: Load, ids, entry: Entry
) -> str | None:
    """None if ``entry`` (read and checked for another load of its key) also fits ``load``; else
    why not."""
    try:
        entry_spec(runner, kv_dtype, load, ids).check(entry)
    except FormatError as e:
        return str(e)
    return None


def below_memory(store: TieredStore, load: Load) -> bool:
    """Whether lookup found ``load``'s entry in a tier below memory."""
    return load.tier is not None and load.tier != store.memory.name


def layer_by_layer(store: TieredStore, load: Load) -> bool:
    """Whether a blend reads this load's entry one layer at a time while it computes (a document
    in a tier below memory) instead of fetching it whole first."""
    return load.key.kind is ChunkKind.DOCUMENT and below_memory(store, load)


def streamed(store: TieredStore, load: Load) -> bool:
    """Whether the KV stream reads this load's entry (a prefix, history or tail chunk in a tier
    below memory) chunk by chunk, at the encoding the bandwidth allows."""
    return load.key.kind is not ChunkKind.DOCUMENT and below_memory(store, load)


def fetch_entries(
    store: TieredStore,
    runner: Transformer,
    kv_dtype: torch.dtype,
    plan: Plan,
    ids,
    *,
    blended: bool = False,
    kv_stream: bool = False,
    have: set[ChunkKey] = frozenset(),
) -> FetchedEntries:
    """Read every entry the plan for the prompt ``ids`` loads from a tier (each distinct key once,
    checked against the first load of it, then against its other loads with ``span_fits``);
    with ``blended``, not the documents a blend reads layer by layer; with ``kv_stream``, not the
    chunks the KV stream reads; never the keys in ``have`` (read already)."""
    wanted: dict[ChunkKey, Load] = {}
    for load in plan.loads:
        if (
            load.tier is None
            or load.key in have
            or (blended and layer_by_layer(store, load))
            or (kv_stream and streamed(store, load))
        ):
            continue
        wanted.setdefault(load.key, load)
    keys = list(wanted)
    got = (
        store.fetch(keys, [entry_spec(runner, kv_dtype, wanted[k], ids) for k in keys])
        if keys
        else []
    )
    out = FetchedEntries()
    for key, f in zip(keys, got):
        out.rejected += f.rejected
        if f.entry is None:
            out.unusable.add(key)
        else:
            out.entries[key], out.served[key] = f.entry, f.tier
    # a key loaded over several spans (a stored history's): check the others too
    for load in plan.loads:
        entry = out.entries.get(load.key)
        if (
            entry is not None
            and load is not wanted[load.key]
            and span_fits(runner, kv_dtype, load, ids, entry)
        ):
            store.discard(load.key)
            del out.entries[load.key], out.served[load.key]
            out.unusable.add(load.key)
            out.rejected += 1
    return out
