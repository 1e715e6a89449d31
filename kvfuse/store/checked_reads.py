"""The one validation path: every entry read back from a tier is checked here before anyone uses it.

The check is ``kv.format.open_entry`` (integrity, the key, and the caller's ``EntrySpec``); for a
tier that streams its reads (the disk's), ``read_entry`` makes the same checks as the bytes arrive,
a few layers at a time, each checked while still in the CPU cache: one pass over memory instead of
a read and then a check. A layer range is checked through its header (``parse_header``: the key,
the spec) and its layers' checksums (``Header.decode_layers``). An unusable entry is deleted from
its tier and counted (``unusable_entries`` in the store's counters, and as an error of that tier,
whose hit becomes a miss).

Signatures. Given an ``EntrySigner`` (``cache.signing_key``), every read from a tier that stores
bytes (disk, Redis, S3: anything that left the process and may have been written by someone
else) checks the entry's signature before anything else of it is used: whole entries, streamed
reads and layer ranges alike. An unsigned or wrongly signed entry is rejected like any unusable
one (removed, a miss, ``unusable_entries``) and counted by reason (``signature_unsigned``,
``signature_mismatch``). The memory tier is not checked: it holds ``Entry`` objects that only
this process put there, either built here or read from a lower tier through this very check.

A seam of its own because the store reads in three ways (whole entries for ``fetch``, one copy
of one tier for ``fetch_encoded``, a layer range for ``fetch_layers``) and all three must check,
reject and count the same way: keeping the checks in one module keeps them one path.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

from kvfuse.kv.format import (
    MIN_READ,
    Entry,
    EntrySpec,
    FormatError,
    Header,
    SignatureError,
    header_length,
    open_entry,
    parse_header,
    read_entry,
)
from kvfuse.kv.keys import ChunkKey
from kvfuse.kv.signing import EntrySigner
from kvfuse.store.results import Encoded, LayerRange, StoreCounters
from kvfuse.tiers.base import Blob, Tier, guarded, nbytes

log = logging.getLogger(__name__)

Checked = tuple[
    "Entry | None", bool
]  # (the checked entry or None, whether a value was there but unusable)


class CheckedReads:
    """Reads from one tier at a time, each checked; see the module docstring.

    Side effects, stated: an unusable entry is deleted from its tier, counted in ``counters``
    (``unusable_entries``, and ``signature_*`` for a signature's reason) and in the tier's stats
    (an error, and its hit turned into a miss). ``signer``: check signatures (None: do not)."""

    _REASONS = {"unsigned": "signature_unsigned", "signature": "signature_mismatch"}

    def __init__(self, counters: StoreCounters, signer: EntrySigner | None = None) -> None:
        self._counters = counters
        self._signer = signer

    def signer_for(self, tier: Tier) -> EntrySigner | None:
        """The signer reads from ``tier`` are checked with: none for a tier of in-process entries."""
        return None if tier.holds_entries else self._signer

    def batch(
        self,
        tier: Tier,
        keys: Sequence[ChunkKey],
        specs: Sequence[EntrySpec | None],
        promoted: bool,
    ) -> Iterator[Checked]:
        """``read`` of every key, in order, lazily: a tier with batch reads (Redis's MGET) is read
        in one call first; otherwise each key is read and checked as the caller asks for it, while
        its bytes are in the CPU cache. ``promoted``: the entries will be kept in memory."""
        if tier.batch_reads:
            values = guarded(tier, "get_many", tier.get_many, [None] * len(keys), list(keys))
            return (self.check(tier, k, v, s, promoted) for k, v, s in zip(keys, values, specs))
        return (self.read(tier, k, s, promoted) for k, s in zip(keys, specs))

    def read(self, tier: Tier, key: ChunkKey, spec: EntrySpec | None, promoted: bool) -> Checked:
        """``key`` read from ``tier`` and checked, as ``check`` answers. A tier that streams its
        reads (disk) hands the bytes to ``read_entry`` piece by piece, which checks each piece as
        it arrives: one pass over memory instead of a read and then a check."""
        if not tier.streams_reads:
            return self.check(tier, key, guarded(tier, "get", tier.get, None, key), spec, promoted)
        return guarded(tier, "read_with", self._streamed, (None, False), tier, key, spec)

    def check(
        self, tier: Tier, key: ChunkKey, value: Blob | None, spec: EntrySpec | None, promoted: bool
    ) -> Checked:
        """(the checked entry of ``value`` or None, whether a value was there but unusable)."""
        if value is None:
            return None, False
        if promoted and not isinstance(value, Entry) and memoryview(value).readonly:
            # Read-only bytes (Redis) are copied once into writable memory: the entry kept in the
            # first tier then decodes without a copy at every later hit.
            value = bytearray(value)
        try:
            return open_entry(value, key, spec, self.signer_for(tier)), False
        except FormatError as e:
            self.reject(tier, key, e)
            return None, True

    def _streamed(self, tier: Tier, key: ChunkKey, spec: EntrySpec | None) -> Checked:
        signer = self.signer_for(tier)
        try:
            return tier.read_with(
                key, lambda readinto, size: read_entry(readinto, size, key, spec, signer)
            ), False
        except FormatError as e:
            self.reject(tier, key, e)
            return None, True

    def reject(self, tier: Tier, key: ChunkKey, error: Exception) -> None:
        """Remove the unusable entry of ``key`` from ``tier``, and count it."""
        log.warning("tier %s: unusable entry %s removed (%s)", tier.name, key, error)
        tier.stats.add(hits=-1, misses=1, errors=1)  # the tier counted a hit; it was not one
        self._counters.add(unusable_entries=1)
        if isinstance(error, SignatureError):
            self._counters.add(**{self._REASONS[error.reason]: 1})
        guarded(tier, "delete", tier.delete, False, key)

    def discard(self, tiers: Sequence[Tier], key: ChunkKey) -> None:
        """Remove ``key`` from every one of ``tiers``, counted as one unusable entry (and an error
        of each tier that held it): an entry found intact but that its codec could not decode."""
        self._counters.add(unusable_entries=1)
        for t in tiers:
            if guarded(t, "delete", t.delete, False, key):
                t.stats.add(errors=1)

    def encoded(
        self, tier: Tier, key: ChunkKey, variant: str, spec: EntrySpec | None
    ) -> Encoded | None:
        """``key``'s copy ``variant`` ("cachegen.1", or "" for the primary) in ``tier`` only,
        falling back to the primary copy there; None if the tier has no usable copy."""
        wanted = [key.encoded_as(*variant.rsplit(".", 1)), key] if variant else [key]
        for k in wanted:
            entry, _ = self.read(tier, k, spec, promoted=False)
            if entry is not None:
                return Encoded(entry, nbytes(entry), k.variant)
        return None

    def layers(
        self, tier: Tier, key: ChunkKey, first: int, last: int, spec: EntrySpec | None
    ) -> LayerRange | None:
        """The KV of layers ``[first, last)`` of ``key`` in ``tier``, reading only the header and
        those layers' bytes (in-process entries: decoding those layers); None on a miss."""
        return guarded(tier, "read layers", self._layers, None, tier, key, first, last, spec)

    def _layers(self, tier: Tier, key: ChunkKey, first: int, last: int, spec: EntrySpec | None):
        try:
            if tier.holds_entries:  # in-process entries: no bytes to read, decode the layers
                value = tier.get(key)
                if value is None:
                    return None
                entry = open_entry(value, key, spec)
                return LayerRange(
                    entry.decode(first, last), entry.positions, first, last, tier.name
                )
            h = self._header(tier, key, spec, self.signer_for(tier))
            if h is None:
                return None
            header, head = h
            start, stop = header.layer_span(first, last)
            data = (
                memoryview(head)[start:stop]
                if stop <= len(head)
                else tier.read_range(key, start, stop)
            )
            if data is None:
                raise FormatError("the entry vanished while it was read")
            kv = header.decode_layers(memoryview(data), first, last)
        except FormatError as e:
            self.reject(tier, key, e)
            return None
        return LayerRange(kv, header.positions, first, last, tier.name)

    @staticmethod
    def _header(
        tier: Tier, key: ChunkKey, spec: EntrySpec | None, signer: EntrySigner | None
    ) -> tuple[Header, bytes | memoryview] | None:
        """The checked header of ``key`` in ``tier`` (with ``signer``: its signature first) and the
        bytes read for it (at least ``MIN_READ``: often the first layers too); None on a miss;
        FormatError if unusable."""
        head = tier.read_range(key, 0, MIN_READ)
        if head is None:
            return None
        need = header_length(head)
        if need > len(head):
            head = bytes(head) + bytes(tier.read_range(key, len(head), need) or b"")
        header = parse_header(head, signer)
        if header.key != str(key):
            raise FormatError(f"entry holds key {header.key!r}, expected {str(key)!r}")
        if spec is not None:
            spec.check(header)
        return header, head
