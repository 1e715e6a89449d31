"""The stored histories: which token ids a conversation's stored KV was built from.

A ``Record`` is written when a turn ends (the prompt that ran and the answer tokens whose KV
exists) and names the entries holding that KV. The next turn finds it, by its
``prompt_cache_key`` when the client sends one, otherwise by content: every record is indexed
under *anchors*, windows of a few ids at content-defined places (where a hash of the window
falls on a fixed residue, about one place in 32), so a later prompt that contains the same
turns, at whatever positions, shares most of a record's anchors. Candidates are ranked by shared
anchors; ``kvfuse.history.align`` then decides how much of each really lines up.

Records live in memory, bounded by count (least recently used first out), and, given a folder
(the disk tier's ``histories/``), in one small file each, so that they survive a restart like
the KV they name (which lives in the tiers). A file is written atomically (a temporary file
``.<pid>.<random>.tmp`` renamed; the temporary files of writers that died, killed in the middle
of a write, are removed at start-up like the disk tier's) and checked when read back (magic, lengths, a checksum of the ids); one that is not
intact is removed and skipped, never used. Without its record a conversation is still found by
content through the key chain (the engine probes the tail keys), as long as its ids re-tokenize
equally. Records are per cache namespace: tenants and models never see each other's.

Whoever can write the folder could otherwise point one scope at another namespace's entries, so a
record is checked when read (``decode_record``): every entry it names must be keyed in its own
namespace, and that namespace must be its scope's (or derived from it by a truncated turn);
and with signing keys (``cache.signing_key``: the entry signer, ``kv/signing.py``) a record is
written with an HMAC tag over all its bytes and one without a valid tag is refused. A refused
record is logged, counted (``HistoryIndex.refused``) and removed, never used: like a damaged one,
the conversation is then still found by content through its (signed) entries.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

from kvfuse.kv.keys import ChunkKey, Namespace
from kvfuse.kv.signing import TAG_SIZE, EntrySigner
from kvfuse.private import make_dirs, write_new

log = logging.getLogger(__name__)
_MAGIC = b"KVFHIST1"
_SIGNED_MAGIC = b"KVFHISS1"  # the same bytes, then an HMAC tag (kv/signing.py) over all of them
_DERIVED = "\x00history:"  # how a derived namespace's salt extends its parent's (reuse/keying.py)
_SUFFIX = ".rec"

_WINDOW = 8
_EVERY = 32  # one anchor per ~32 tokens (and one at the start)
_PER_ANCHOR = 16  # records remembered per anchor (the most recent)


def anchors(ids: Sequence[int]) -> set[int]:
    """Content-defined anchors of ``ids``: the first window, and every window whose hash falls on
    residue 0 modulo ``_EVERY``. Hashes of int tuples are stable within a process (no salting)."""
    out = set()
    if len(ids) >= 1:
        out.add(hash(("head", tuple(ids[:_WINDOW]))))
    for i in range(0, len(ids) - _WINDOW + 1):
        h = hash(tuple(ids[i : i + _WINDOW]))
        if (h >> 5) % _EVERY == 0:
            out.add(h)
    return out


@dataclass(frozen=True)
class StoredEntry:
    """One entry of a stored history (a chunk of its chain, or its tail): the tokens it holds
    were at stored positions ``[source, source + tokens)``."""

    key: ChunkKey
    source: int
    tokens: int


@dataclass(eq=False)
class Record:
    """A stored history: ``ids`` (the KV's tokens, in slot order), the namespace its entries are
    keyed in, and the entries holding its KV."""

    scope: str  # the cache namespace (tenant, model, salt) it may be found from
    ids: np.ndarray
    namespace: Namespace  # of its entries (a derived one after a truncated turn)
    entries: tuple[StoredEntry, ...] = ()
    cache_key: str | None = None
    anchors: frozenset[int] = field(default_factory=frozenset)
    serial: int = 0
    file: str | None = None  # its file in the index's folder

    def __len__(self) -> int:
        return len(self.ids)


class RecordRefused(ValueError):
    """A record that is intact but may not be used: unsigned or badly signed where signing is on
    (``reason`` "unsigned" / "signature"), or naming entries outside its scope ("scope")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode_record(rec: Record, signer: EntrySigner | None = None) -> bytes:
    """The bytes of a record's file: magic, a length-prefixed JSON header, the ids (u32 LE); with
    ``signer``, another magic and the HMAC tag of every byte before it appended (the entry
    signer's key: only a holder of it can write a record a signing reader uses)."""
    ids = np.ascontiguousarray(rec.ids, dtype="<u4").tobytes()
    header = json.dumps(
        {
            "scope": rec.scope,
            "cache_key": rec.cache_key,
            "namespace": dataclasses.asdict(rec.namespace),
            "entries": [[str(e.key), e.source, e.tokens] for e in rec.entries],
            "n": len(rec.ids),
            "xxh64": xxhash.xxh64_hexdigest(ids),
        }
    ).encode()
    if signer is None:
        return _MAGIC + struct.pack("<I", len(header)) + header + ids
    body = _SIGNED_MAGIC + struct.pack("<I", len(header)) + header + ids
    return body + signer.sign(body)


def _unsigned_body(data: bytes, signer: EntrySigner | None) -> bytes:
    """``data`` without its tag, checked against ``signer`` when there is one (RecordRefused
    for no tag or a bad one); without a signer a tag is not checked (like an entry's)."""
    signed = data[:8] == _SIGNED_MAGIC
    if signed:
        if len(data) < 12 + TAG_SIZE:
            raise ValueError("the signed record is truncated")
        body, tag = data[:-TAG_SIZE], data[-TAG_SIZE:]
        if signer is not None and not signer.verify(body, tag):
            raise RecordRefused("signature", "the record's tag is not one of an accepted key")
        return _MAGIC + body[8:]
    if signer is not None and data[:8] == _MAGIC:
        raise RecordRefused("unsigned", "the record is not signed and signing is on")
    return data


def decode_record(data: bytes, signer: EntrySigner | None = None) -> Record:
    """The record of a file's bytes; ValueError naming what is wrong with them, RecordRefused
    (a ValueError) for one that is intact but may not be used: see ``check_scope``, and with
    ``signer``, one without a valid tag."""
    data = _unsigned_body(bytes(data), signer)
    if data[:8] != _MAGIC or len(data) < 12:
        raise ValueError("not a kvfuse history record")
    (n,) = struct.unpack_from("<I", data, 8)
    try:
        h = json.loads(data[12 : 12 + n])
        ids = data[12 + n :]
        if len(ids) != 4 * h["n"] or xxhash.xxh64_hexdigest(ids) != h["xxh64"]:
            raise ValueError("the ids are damaged or truncated")
        entries = tuple(StoredEntry(ChunkKey.parse(k), int(s), int(t)) for k, s, t in h["entries"])
        rec = Record(
            str(h["scope"]),
            np.frombuffer(ids, dtype="<u4").astype(np.uint32),
            Namespace(**h["namespace"]),
            entries,
            h["cache_key"],
        )
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"the record header is damaged: {e}") from None
    check_scope(rec)
    return rec


def scope_namespace_ids(namespace: Namespace) -> tuple[str, str]:
    """The key prefix of the namespace ``namespace`` was derived from (its salt before any
    ``\x00history:`` part; itself when not derived) and ``namespace``'s own id."""
    base = dataclasses.replace(namespace, salt=namespace.salt.split(_DERIVED, 1)[0])
    return base.key_prefix(), namespace.short_id()


def check_scope(rec: Record) -> None:
    """RecordRefused unless the record's namespace is its scope's (or derived from it) and every
    entry it names is keyed in that namespace: a record (a file in a shared folder) must not
    point one scope at another tenant's or namespace's entries. A scope is a namespace's key
    prefix, optionally followed by an end user's part (``reuse.keying.history_scope``)."""
    prefix, own = scope_namespace_ids(rec.namespace)
    if rec.scope.split("\x00", 1)[0] != prefix:
        raise RecordRefused("scope", "the record's namespace is not its scope's")
    foreign = [e for e in rec.entries if e.key.namespace_id != own]
    if foreign:
        raise RecordRefused(
            "scope", f"{len(foreign)} of the record's entries are keyed outside its namespace"
        )


class HistoryIndex:
    """Records by ``(scope, prompt_cache_key)`` and by anchor; at most ``capacity`` records."""

    def __init__(
        self,
        capacity: int = 2048,
        path: str | os.PathLike | None = None,
        signer: EntrySigner | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError("the history index capacity must be >= 0")
        self.capacity = capacity
        self.path = Path(path) if path is not None else None
        self.signer = signer  # the entry signer: records are signed and checked with its keys
        # serial -> record, least recent first
        self._records: OrderedDict[int, Record] = OrderedDict()
        self._by_key: dict[tuple[str, str], int] = {}
        self._by_anchor: dict[tuple[str, int], OrderedDict[int, None]] = {}
        self._serials = itertools.count(1)
        self._lock = threading.Lock()
        self.damaged = 0  # record files found damaged (removed, never used)
        # intact record files refused (removed, never used): unsigned or badly signed with signing
        # on, or naming entries outside their scope; by reason
        self.refused: dict[str, int] = {}
        if self.path is not None and capacity:
            self._load()

    def _load(self, stale_temp_s: float = 600.0) -> None:
        """The records of the folder, oldest first (the newest ``capacity`` are kept); the temp
        files of dead writers are removed (they would pile up, one per write cut short). A folder
        that cannot be read is logged and skipped: records are hints."""
        from kvfuse.tiers.disk.files import stale_temp

        try:
            make_dirs(self.path)
            listing = list(os.scandir(self.path))
        except OSError as e:
            log.warning(
                "cannot read the history records in %s (%s); starting without them", self.path, e
            )
            return
        now, files = time.time(), []
        for f in listing:
            try:
                st = f.stat()
                old_temp = (
                    f.name.startswith(".")
                    and f.name.endswith(".tmp")
                    and now - st.st_mtime > stale_temp_s
                )
                # (old names had no pid)
                if old_temp or stale_temp(f.name, st.st_mtime, now, stale_temp_s):
                    os.unlink(f.path)
                elif f.name.endswith(_SUFFIX) and f.is_file():
                    files.append((st.st_mtime_ns, f))
            except OSError:
                continue  # gone meanwhile, or not ours to touch
        files = [f for _, f in sorted(files, key=lambda t: t[0])]
        for f in files[-self.capacity :]:
            try:
                rec = decode_record(Path(f.path).read_bytes(), self.signer)
            except (OSError, ValueError) as e:
                log.warning("history record %s is unusable (%s): removed", f.path, e)
                if isinstance(e, RecordRefused):
                    self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
                else:
                    self.damaged += 1
                self._unlink(f.name)
                continue
            rec.file = f.name
            self._insert(rec)
        for f in files[: -self.capacity]:
            self._unlink(f.name)

    def _write(self, rec: Record) -> None:
        if self.path is None:
            return
        token = secrets.token_hex(12)
        name = token + _SUFFIX
        # the pid: a dead writer's is removed at start-up
        tmp = self.path / f".{os.getpid()}.{token}.tmp"
        try:
            write_new(tmp, encode_record(rec, self.signer))  # 0600 (kvfuse.private)
            os.replace(tmp, self.path / name)
            rec.file = name
        except OSError as e:  # a record is a hint: without its file the history is found by content
            log.warning("could not write a history record (%s)", e)
            tmp.unlink(missing_ok=True)

    def _unlink(self, name: str | None) -> None:
        if self.path is not None and name:
            try:
                (self.path / name).unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not remove history record %s (%s)", name, e)

    def add(
        self,
        scope: str,
        ids: Sequence[int],
        namespace: Namespace,
        entries: tuple = (),
        cache_key: str | None = None,
        replaces: Record | None = None,
    ) -> Record | None:
        """Remember a history; ``replaces`` (the record this turn extended) is dropped when the
        new one contains all of it. None when the index holds nothing (capacity 0)."""
        if self.capacity == 0 or len(ids) == 0:
            return None
        rec = Record(scope, np.asarray(ids, dtype=np.uint32), namespace, tuple(entries), cache_key)
        self._write(rec)
        with self._lock:
            if (
                replaces is not None
                and len(replaces) <= len(rec.ids)
                and np.array_equal(rec.ids[: len(replaces)], replaces.ids)
            ):
                self._drop(replaces)
            self._insert_locked(rec)
        return rec

    def _insert(self, rec: Record) -> None:
        with self._lock:
            self._insert_locked(rec)

    def _insert_locked(self, rec: Record) -> None:
        # computed under the lock: cheap (~1 ms / 4k ids)
        rec.anchors = frozenset(anchors(rec.ids.tolist()))
        rec.serial = next(self._serials)
        if rec.cache_key is not None:
            old = self._by_key.get((rec.scope, rec.cache_key))
            if old is not None and old in self._records:
                self._drop(self._records[old])
            self._by_key[(rec.scope, rec.cache_key)] = rec.serial
        self._records[rec.serial] = rec
        for a in rec.anchors:
            bucket = self._by_anchor.setdefault((rec.scope, a), OrderedDict())
            bucket[rec.serial] = None
            while len(bucket) > _PER_ANCHOR:
                bucket.popitem(last=False)
        while len(self._records) > self.capacity:
            self._drop(next(iter(self._records.values())))

    def _drop(self, rec: Record) -> None:
        if self._records.pop(rec.serial, None) is None:
            return
        self._unlink(rec.file)
        if rec.cache_key is not None and self._by_key.get((rec.scope, rec.cache_key)) == rec.serial:
            del self._by_key[(rec.scope, rec.cache_key)]
        for a in rec.anchors:
            bucket = self._by_anchor.get((rec.scope, a))
            if bucket is not None:
                bucket.pop(rec.serial, None)
                if not bucket:
                    del self._by_anchor[(rec.scope, a)]

    def candidates(
        self,
        scope: str,
        ids: Sequence[int],
        cache_key: str | None = None,
        limit: int = 4,
        by_content: bool = True,
    ) -> list[Record]:
        """Records that may line up with ``ids``: the ``cache_key`` record first, then (with
        ``by_content``) by shared anchors (ties: the most recent first), at most ``limit``."""
        out: list[Record] = []
        with self._lock:
            if cache_key is not None:
                serial = self._by_key.get((scope, cache_key))
                if serial is not None and serial in self._records:
                    out.append(self._records[serial])
            votes: dict[int, int] = {}
            for a in anchors(ids) if by_content else ():
                for serial in self._by_anchor.get((scope, a), ()):
                    votes[serial] = votes.get(serial, 0) + 1
            ranked = sorted(votes, key=lambda s: (votes[s], s), reverse=True)
            out += [
                self._records[s]
                for s in ranked
                if s in self._records and self._records[s] not in out
            ]
            out = out[:limit]
            for rec in out:
                self._records.move_to_end(rec.serial)
        return out

    def delete_prefix(self, prefix: str) -> int:
        """Forget the records whose scope starts with ``prefix`` (a tenant's, on clearing)."""
        with self._lock:
            doomed = [r for r in self._records.values() if r.scope.startswith(prefix)]
            for r in doomed:
                self._drop(r)
        return len(doomed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
