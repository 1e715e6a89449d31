"""Per-tier encodings: the codec each lower tier writes, and the extra CacheGen levels (variants)
written beside a chunk for the streaming loader; re-encoding an entry for them; and, with a
signer, the signature every entry written to a lower tier carries.

Each lower tier may have its own codec (``codecs``: e.g. raw in memory, CacheGen on disk and
Redis): an entry put in another encoding is re-encoded for that tier. The ``stream_levels`` of
CacheGen are written too, under the chunk's variant keys (``ChunkKey.encoded_as``), so that the
streaming loader can read a chunk at the level its bandwidth allows (``TieredStore.fetch_encoded``).
Readers accept any codec, so lookups and fetches do not depend on this; entries written before a
codec change stay usable.

A seam of its own because it is the one step of the background writes that decodes and encodes
KV (CPU-heavy, and the only part of the store that knows codecs): the write-behind queue moves
bytes to tiers; this decides which bytes each tier gets. A memo shared by the tiers of one batch
encodes (and signs) an entry once per encoding, however many tiers want it.

Signing lives here, on the one path by which entries reach the lower tiers (the write-behind
queue), rather than in ``encode_entry``'s callers (the saver, the prefill, the blend loader, the
vLLM worker...): they build in-process entries for the memory tier, which never leaves the
process and needs no signature, and none of them has to know the key. Signing hashes every
payload byte (SHA-256), so it runs on the background writer's thread, off the request path.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

from kvfuse.codecs import get_codec
from kvfuse.codecs.base import Codec
from kvfuse.kv.format import FormatError, encode_entry, open_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.kv.signing import EntrySigner
from kvfuse.store.results import StoreCounters
from kvfuse.tiers.base import Blob, Tier

log = logging.getLogger(__name__)

Items = list[tuple[ChunkKey, Blob]]


class Transcoder:
    """Which encodings the lower tiers get, and the re-encoding into them.

    ``counters`` receives ``reencoded`` (an entry encoded anew) and ``reencode_errors`` (a value
    that could not be: damaged, or KV the codec refuses; the write of that copy is skipped).
    ``signer``: every entry written to a lower tier is signed with it (None: as it is)."""

    def __init__(
        self,
        codecs: Mapping[str, Codec],
        stream_levels: Sequence[int],
        counters: StoreCounters,
        signer: EntrySigner | None = None,
    ) -> None:
        self.codecs: dict[str, Codec] = dict(
            codecs
        )  # a tier's write codec by name (absent: as put)
        self.stream_levels = tuple(sorted(set(stream_levels)))
        self.stream_codecs = [get_codec("cachegen", level) for level in self.stream_levels]
        self._counters = counters
        self.signer = signer

    def use_model(
        self, layer_types: Sequence[str], level: int = 0, k_cap: float | None = None
    ) -> None:
        """Encode for a model whose layers are ``layer_types`` and whose calibrated CacheGen level
        and K cap are ``level`` (0: none) and ``k_cap``: ``Codec.for_model``. The level replaces
        only a tier codec configured at level 0; the stream levels are explicit and stay (the cap,
        a property of the model's keys, applies to every CacheGen encoding)."""
        self.codecs = {
            name: c.for_model(layer_types, level, k_cap) for name, c in self.codecs.items()
        }
        self.stream_codecs = [c.for_model(layer_types, k_cap=k_cap) for c in self.stream_codecs]

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
        if codec is None and not self.stream_codecs and self.signer is None:
            return batch
        out = []
        for key, value in batch:
            primary = self._reencode(key, value, codec, memo)
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

    def _reencode(self, key: ChunkKey, value: Blob, codec: Codec | None, memo: dict) -> Blob | None:
        """``value`` as an entry of ``codec`` under ``key`` (itself when it is one already; None:
        the value's own encoding), signed when there is a signer; None (counted, logged) when it
        cannot be (a damaged value, KV the codec refuses)."""
        memo_key = (
            (str(key), codec.name, codec.level) if codec is not None else (str(key), None, None)
        )
        if memo_key in memo:
            return memo[memo_key]
        if codec is None and self.signer is None:
            return value  # as put (the memo would gain nothing)
        try:
            entry = open_entry(
                value
            )  # an in-process value (put by this process): nothing to authenticate
            if codec is not None and (
                entry.key != str(key)
                or (entry.codec.name, entry.codec.level) != (codec.name, codec.level)
            ):
                entry = encode_entry(entry.chunk(), key, codec)
                self._counters.add(reencoded=1)
            out = entry if self.signer is None else entry.signed(self.signer)
        except (FormatError, ValueError) as e:
            name, level = (codec.name, codec.level) if codec is not None else ("its own codec", 0)
            log.warning("cannot encode %s with %s level %d: %s", key, name, level, e)
            self._counters.add(reencode_errors=1)
            out = None
        memo[memo_key] = out
        return out
