"""History records at rest: signed with the entry signer, checked against their scope, and the
files kvfuse writes only their owner can read (issue 39, items 9 and 12)."""

from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np
import pytest

from kvfuse.history.records import (
    HistoryIndex,
    Record,
    RecordRefused,
    StoredEntry,
    check_scope,
    decode_record,
    encode_record,
)
from kvfuse.history.response_store import ResponseStore
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.kv.signing import EntrySigner
from kvfuse.private import make_dirs, touch, write_new
from kvfuse.tiers.disk.files import stage_file

KEY_A, KEY_B = b"a" * 32, b"b" * 32
ALICE = Namespace("model", "float16", "L2xH1xD4", tenant="alice")
BOB = Namespace("model", "float16", "L2xH1xD4", tenant="bob")
IDS = list(range(1000, 1012))


def record(ns: Namespace, scope_ns: Namespace | None = None, entries_ns: Namespace | None = None):
    """A record of ``IDS`` in ``ns``, scoped to ``scope_ns``, naming entries of ``entries_ns``."""
    keys = prefix_keys(IDS[:8], 4, entries_ns or ns)
    entries = tuple(StoredEntry(k, i * 4, 4) for i, k in enumerate(keys))
    return Record((scope_ns or ns).key_prefix(), np.asarray(IDS, np.uint32), ns, entries)


def derived(ns: Namespace, *parts: str) -> Namespace:
    return dataclasses.replace(ns, salt=ns.salt + "".join("\x00history:" + p for p in parts))


# ------------------------------------------------------------------------------ scope


@pytest.mark.parametrize(
    "rec, ok",
    [
        (record(ALICE), True),
        (record(derived(ALICE, "ab")), False),  # scope is the derived one's own: not a scope
        (record(derived(ALICE, "ab"), scope_ns=ALICE), True),  # a truncated turn's namespace
        (record(derived(ALICE, "ab", "cd"), scope_ns=ALICE), True),  # truncated twice
        (record(ALICE, entries_ns=BOB), False),  # alice's scope naming bob's entries
        (record(BOB, scope_ns=ALICE), False),  # alice's scope, bob's namespace
        (record(derived(BOB, "ab"), scope_ns=ALICE), False),
        (record(derived(ALICE, "ab"), scope_ns=ALICE, entries_ns=ALICE), False),
    ],
)
def test_a_record_is_used_only_in_its_own_scope(rec, ok):
    if ok:
        check_scope(rec)
    else:
        with pytest.raises(RecordRefused) as e:
            check_scope(rec)
        assert e.value.reason == "scope"


def test_an_end_users_scope_is_within_its_namespace():
    rec = record(ALICE)
    rec.scope += "\x00user:" + "0" * 32
    check_scope(rec)


def test_a_record_outside_its_scope_is_refused_when_read():
    with pytest.raises(RecordRefused):
        decode_record(encode_record(record(ALICE, entries_ns=BOB)))


# ------------------------------------------------------------------------------ signing


def test_signed_records_round_trip_and_tampering_is_refused():
    signer = EntrySigner([KEY_A])
    data = encode_record(record(ALICE), signer)
    assert decode_record(data, signer).ids.tolist() == IDS
    assert decode_record(data, EntrySigner([KEY_B, KEY_A])).ids.tolist() == IDS  # rotation
    assert decode_record(data).ids.tolist() == IDS  # no signer: the tag is not checked
    cases = {
        "signature": [
            data[:-1] + bytes([data[-1] ^ 1]),  # a bit of the tag
            data.replace(b'"cache_key": null', b'"cache_key": "x!!"'),  # the header, same length
            encode_record(record(ALICE), EntrySigner([KEY_B])),  # another key
        ],
        "unsigned": [encode_record(record(ALICE))],
    }
    for reason, blobs in cases.items():
        for blob in blobs:
            with pytest.raises(RecordRefused) as e:
                decode_record(blob, signer)
            assert e.value.reason == reason
    with pytest.raises(ValueError):
        decode_record(data[:20], signer)  # truncated


def test_an_index_with_a_signer_refuses_unsigned_and_foreign_records_and_counts_them(tmp_path):
    signer = EntrySigner([KEY_A])
    signed = HistoryIndex(capacity=8, path=tmp_path, signer=signer)
    assert signed.add(ALICE.key_prefix(), IDS, ALICE, record(ALICE).entries, "c1") is not None
    plain = HistoryIndex(capacity=8, path=tmp_path)  # a writer without the key
    plain.add(ALICE.key_prefix(), list(range(5000, 5100)), ALICE)
    forged = record(ALICE, entries_ns=BOB)  # a well-signed record naming bob's entries
    write_new(tmp_path / "forged.rec", encode_record(forged, signer))
    again = HistoryIndex(capacity=8, path=tmp_path, signer=signer)
    assert len(again) == 1 and again.refused == {"unsigned": 1, "scope": 1}
    assert again.damaged == 0 and len(list(tmp_path.glob("*.rec"))) == 1  # refused: removed
    assert again.candidates(ALICE.key_prefix(), [1], cache_key="c1")[0].ids.tolist() == IDS


# ------------------------------------------------------------------------------ modes


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o002)  # what a permissive deployment has: modes must not depend on it
    yield
    os.umask(old)


def test_files_and_folders_kvfuse_creates_are_its_owners_only(tmp_path, loose_umask):
    make_dirs(tmp_path / "a" / "b")
    assert mode(tmp_path / "a") == mode(tmp_path / "a" / "b") == 0o700
    os.chmod(tmp_path / "a", 0o755)
    make_dirs(tmp_path / "a" / "b" / "c")
    assert mode(tmp_path / "a") == 0o755  # an existing folder is left as it is
    touch(tmp_path / "t")
    write_new(tmp_path / "w", b"data")
    stage_file(str(tmp_path / "d" / "x.tmp"), [b"entry"], fsync=False)
    assert mode(tmp_path / "t") == mode(tmp_path / "w") == mode(tmp_path / "d" / "x.tmp") == 0o600
    assert mode(tmp_path / "d") == 0o700 and (tmp_path / "w").read_bytes() == b"data"
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "w", b"again")


def test_history_records_and_the_responses_store_are_private(tmp_path, loose_umask):
    index = HistoryIndex(capacity=8, path=tmp_path / "histories")
    index.add(ALICE.key_prefix(), IDS, ALICE)
    assert mode(tmp_path / "histories") == 0o700
    assert [mode(p) for p in (tmp_path / "histories").iterdir()] == [0o600]
    store = ResponseStore(tmp_path / "home" / "responses.sqlite3")
    assert len(store) == 0
    assert mode(tmp_path / "home") == 0o700
    files = list((tmp_path / "home").iterdir())
    assert files and all(mode(p) == 0o600 for p in files)  # the database, its -wal and -shm
