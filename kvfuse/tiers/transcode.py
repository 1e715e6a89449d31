"""Per-tier encodings: the codec each lower tier writes, and the extra CacheGen levels (variants)
written beside a chunk for the streaming loader; re-encoding an entry for them.

Each lower tier may have its own codec (``codecs``: e.g. raw in memory, CacheGen on disk and
Redis): an entry put in another encoding is re-encoded for that tier. The ``stream_levels`` of
CacheGen are written too, under the chunk's variant keys (``ChunkKey.encoded_as``), so that the
streaming loader can read a chunk at the level its bandwidth allows (``TieredStore.fetch_encoded``).
Readers accept any codec, so lookups and fetches do not depend on this; entries written before a
codec change stay usable.

A seam of its own because it is the one step of the background writes that decodes and encodes
KV (CPU-heavy, and the only part of the store that knows codecs): the write-behind queue moves
bytes to tiers; this decides which bytes each tier gets. A memo shared by the tiers of one batch
encodes an entry once per encoding, however many tiers want it.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

from kvfuse.codecs import get_codec
from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, FormatError, encode_entry, open_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier
from kvfuse.tiers.results import StoreCounters

log = logging.getLogger(__name__)

Items = list[tuple[ChunkKey, Blob]]


class Transcoder:
    """Which encodings the lower tiers get, and the re-encoding into them.

    ``counters`` receives ``reencoded`` (an entry encoded anew) and ``reencode_errors`` (a value
    that could not be: damaged, or KV the codec refuses; the write of that copy is skipped)."""

    def __init__(self, codecs: Mapping[str, Codec], stream_levels: Sequence[int], counters: StoreCounters) -> None:
        self.codecs: dict[str, Codec] = dict(codecs)  # a tier's write codec by name (absent: as put)
        self.stream_levels = tuple(sorted(set(stream_levels)))
        self.stream_codecs = [get_codec("cachegen", level) for level in self.stream_levels]
        self._counters = counters

    def use_model(self, layer_types: Sequence[str], level: int = 0) -> None:
        """Encode for a model whose layers are ``layer_types`` and whose calibrated CacheGen level
        is ``level`` (0: none): ``Codec.for_model``. The level replaces only a tier codec configured
        at level 0; the stream levels are explicit and stay."""
        self.codecs = {name: c.for_model(layer_types, level) for name, c in self.codecs.items()}
        self.stream_codecs = [c.for_model(layer_types) for c in self.stream_codecs]

    def encodings(self) -> list[str]:
        """The variants a chunk has in a lower tier besides its primary copy ("cachegen.1", ...)."""
        return [f"{c.name}.{c.level}" for c in self.stream_codecs]

    def variants(self, key: ChunkKey) -> list[ChunkKey]:
        """The keys of ``key``'s extra encodings (none for a key that is a variant itself)."""
        return [] if key.variant else [key.encoded_as(c.name, c.level) for c in self.stream_codecs]

    def with_variants(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """``keys``, then the variants of each."""
        keys = list(keys)
        return keys + [v for k in keys for v in self.variants(k)]

    def encoded_for(self, tier: Tier, batch: Items, memo: dict) -> Items:
        """The writes of ``batch`` for ``tier``: each entry in the tier's codec, plus its variants.
        ``memo`` shares the encodings between the tiers of one batch."""
        codec = self.codecs.get(tier.name)
        if codec is None and not self.stream_codecs:
            return batch
        out = []
        for key, value in batch:
            primary = value if codec is None else self._reencode(key, value, codec, memo)
            if primary is not None:
                out.append((key, primary))
            if key.variant:
                continue
            for c in self.stream_codecs:
                if codec is not None and (codec.name, codec.level) == (c.name, c.level):
                    continue  # the primary copy is this level already
                vkey = key.encoded_as(c.name, c.level)
                encoded = self._reencode(vkey, value, c, memo)
                if encoded is not None:
                    out.append((vkey, encoded))
        return out

    def _reencode(self, key: ChunkKey, value: Blob, codec: Codec, memo: dict) -> Entry | None:
        """``value`` as an entry of ``codec`` under ``key`` (itself when it is one already); None
        (counted, logged) when it cannot be (a damaged value, KV the codec refuses)."""
        memo_key = (str(key), codec.name, codec.level)
        if memo_key in memo:
            return memo[memo_key]
        try:
            entry = open_entry(value)
            if entry.key == str(key) and (entry.codec.name, entry.codec.level) == (codec.name, codec.level):
                out = entry
            else:
                out = encode_entry(entry.chunk(), key, codec)
                self._counters.add(reencoded=1)
        except (FormatError, ValueError) as e:
            log.warning("cannot encode %s with %s level %d: %s", key, codec.name, codec.level, e)
            self._counters.add(reencode_errors=1)
            out = None
        memo[memo_key] = out
        return out
