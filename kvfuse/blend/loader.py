"""Loading documents' KV into the live cache layer by layer, on a background thread.

A blend computes layer i while this thread writes layer i+1 of every document (CacheBlend's
pipelining): an entry in memory is decoded one layer at a time, an entry on disk or in Redis is
read one layer range at a time (``TieredStore.fetch_layers``: only those bytes, checked against
the entry's layer table), so a slow tier is hidden behind the recompute. Each layer's keys are
rotated to the documents' positions as they arrive. ``wait(layer)`` blocks until that layer of
every document is in place, and raises ``LayerLoadFailed`` if one could not be read (the engine
then plans around that document and starts the prefill again).

Documents read from a lower tier are kept, layer by layer, and can be promoted into the memory
tier once the blend is done (off the time to first token).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import Entry, EntrySpec, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.store import TieredStore
from kvfuse.threads import helper_thread

log = logging.getLogger(__name__)


class LayerLoadFailed(Exception):
    """A document's layer could not be read (missing, damaged, or not as expected)."""

    def __init__(self, key: ChunkKey):
        super().__init__(f"document entry {key} could not be read")
        self.key = key


@dataclass
class DocumentLoad:
    """One document: the slots it fills, how far its keys move, and where its KV comes from (an
    entry already in hand, or a key to read layer by layer with ``spec``)."""

    key: ChunkKey
    start: int
    end: int
    shift: int
    entry: Entry | None = None
    spec: EntrySpec | None = None
    tier: str | None = None  # the tier that served it (filled in while loading)
    # kept for promotion (lower tiers only)
    layers: list[torch.Tensor] = field(default_factory=list)


class LayerLoader:
    """Fills the documents' KV of each layer in order on a thread of its own; see the module docstring."""

    def __init__(
        self,
        runner: Transformer,
        kv: KVCache,
        docs: list[DocumentLoad],
        store: TieredStore | None,
        keep_for_promotion: bool = True,
    ):
        self.runner, self.kv, self.docs, self.store = runner, kv, docs, store
        self.keep = keep_for_promotion
        self._ready = [threading.Event() for _ in range(runner.config.num_layers)]
        self._failed: ChunkKey | None = None
        self._stop = threading.Event()
        self._thread = helper_thread(self._run, "kvfuse-layer-loader")

    def start(self) -> LayerLoader:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for layer in range(len(self._ready)):
                if self._stop.is_set():
                    break
                for doc in self.docs:
                    if not self._load(doc, layer):
                        self._failed = doc.key
                        return
                self._ready[layer].set()
        except Exception:  # a bug here must not hang the request waiting for a layer
            log.exception("the layer loader failed")
            self._failed = self.docs[0].key if self.docs else None
        finally:
            for event in self._ready:  # wake any waiter: wait() reports the failure
                event.set()

    @torch.inference_mode()
    def _load(self, doc: DocumentLoad, layer: int) -> bool:
        if doc.entry is not None:
            data = doc.entry.decode(layer, layer + 1)
        else:
            got = (
                self.store.fetch_layers(doc.key, layer, layer + 1, doc.spec)
                if self.store is not None
                else None
            )
            if got is None:
                return False
            data, doc.tier = got.kv, got.tier
            if self.keep:
                doc.layers.append(data)
        self.kv.write_layers(doc.start, data, layer)
        self.runner.rotate_keys(self.kv, range(layer, layer + 1), doc.start, doc.end, doc.shift)
        return True

    def wait(self, layer: int) -> None:
        """Block until ``layer`` of every document is in place; LayerLoadFailed if one failed."""
        self._ready[layer].wait()
        if self._failed is not None:
            raise LayerLoadFailed(self._failed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def promotions(self, codec) -> list[tuple[ChunkKey, Entry]]:
        """Entries of the documents read from a lower tier, rebuilt from their layers (as stored:
        positions and keys before the move), for the memory tier."""
        out = []
        for doc in self.docs:
            if doc.entry is None and self.keep and len(doc.layers) == len(self._ready):
                kv = torch.cat(doc.layers, dim=0)
                positions = torch.arange(doc.start - doc.shift, doc.end - doc.shift)
                # what the read was checked against
                ids = doc.spec.token_ids if doc.spec is not None else None
                out.append(
                    (
                        doc.key,
                        encode_entry(
                            KVChunk(kv=kv, positions=positions), doc.key, codec, token_ids=ids
                        ),
                    )
                )
        return out
