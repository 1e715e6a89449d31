"""Chunk keys: exact golden values, cross-process stability, namespace separation, the prefix property."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfuse.kv.format import FORMAT_VERSION
from kvfuse.kv.keys import (
    ChunkKey,
    ChunkKind,
    Namespace,
    chunk_spans,
    document_key,
    layout_of,
    prefix_keys,
    tail_key,
)

NS = Namespace("sha256:abc", "float16", layout_of(30, 3, 64))
NS2 = Namespace("sha256:abc", "bfloat16", "L30xH3xD64", 1, "salt-a", tenant="tenant-a")

# Computed once from the documented encoding; any change of the encoding must fail here.
# (NS uses the current FORMAT_VERSION: recomputed when format version 3 changed every namespace,
# and again for key version 3: 64-bit tenant tags and the cache salt's tag.)
GOLDEN = [
    (
        NS,
        list(range(8)),
        4,
        [
            "00f27a8a6e32026508899222147a4061414f3a21887feeec:p:d69fcc4879c15b4082d1b7ced95ba03c49da407eea52af12bb2928ea49ea3627",
            "00f27a8a6e32026508899222147a4061414f3a21887feeec:p:654584dd0b89f52b16fbad3f601033ee7ceb485ba0c8676ea7669d42251e7bb0",
        ],
    ),
    (
        NS2,
        [1, 2, 3, 2**32 - 1, 0, 5, 6, 7, 9],
        3,
        [
            "91fe914a0fe0baf7d3acdadbd465c789532696a7e66e14cb:p:173ad41115a34d0bb853856deea3d701ceb5b788b5a0eccb95fd697306d83c9d",
            "91fe914a0fe0baf7d3acdadbd465c789532696a7e66e14cb:p:31b6e4b9aefb1ff261a5e8816be9c16be1783be760b2aa713615b5f04648c40b",
            "91fe914a0fe0baf7d3acdadbd465c789532696a7e66e14cb:p:9bbacb7c4d6e660d0b6c6fed133af921080a5edc9f49a909a9a20661f513b0ba",
        ],
    ),
]
GOLDEN_DOC = "00f27a8a6e32026508899222147a4061414f3a21887feeec:d:e8a55331c147dfa2d8dc46cd477f19e2e40351e669725b39c4979fa35ad7ef60"
GOLDEN_TAIL = "00f27a8a6e32026508899222147a4061414f3a21887feeec:t:86241041637ff0809c3f48c0b8dd9c85b7a80a6e60ba91cec86085eab4c40864"


@pytest.mark.parametrize("ns,tokens,chunk,expected", GOLDEN)
def test_golden_prefix_keys(ns, tokens, chunk, expected):
    assert [str(k) for k in prefix_keys(tokens, chunk, ns)] == expected


def test_golden_document_key():
    assert str(document_key([10, 20, 30], NS)) == GOLDEN_DOC


def test_golden_tail_key():
    assert str(tail_key(prefix_keys(range(8), 4, NS)[1], [8, 9], NS)) == GOLDEN_TAIL


def test_golden_matches_the_documented_encoding():
    """Recompute the first golden key from the module docstring's recipe, independently."""

    def s(x: str) -> bytes:
        return struct.pack("<I", len(x.encode())) + x.encode()

    enc = (
        b"kvfuse.ns.v3\0"
        + s("sha256:abc")
        + s("float16")
        + s("L30xH3xD64")
        + struct.pack("<I", FORMAT_VERSION)
        + s("")
        + s("")
        + s("")
    )  # tenant, salt, cache_salt
    ns_digest = hashlib.sha256(enc).digest()
    tag = hashlib.sha256(b"kvfuse.tenant\0" + s("")).hexdigest()[:16]
    tag += hashlib.sha256(b"kvfuse.salt\0" + s("") + s("")).hexdigest()[:16]
    root = hashlib.sha256(b"kvfuse.root.v1\0" + ns_digest).digest()
    h0 = hashlib.sha256(
        b"kvfuse.prefix\0" + root + struct.pack("<I", 4) + struct.pack("<4I", 0, 1, 2, 3)
    ).digest()
    assert NS.digest() == ns_digest
    assert str(prefix_keys(range(8), 4, NS)[0]) == f"{tag}{ns_digest.hex()[:16]}:p:{h0.hex()}"
    tail = hashlib.sha256(
        b"kvfuse.tail\0" + h0 + struct.pack("<Q", 2) + struct.pack("<2I", 4, 5)
    ).digest()
    assert (
        str(tail_key(prefix_keys(range(4), 4, NS)[0], [4, 5], NS))
        == f"{tag}{ns_digest.hex()[:16]}:t:{tail.hex()}"
    )
    no_parent = hashlib.sha256(
        b"kvfuse.tail\0" + root + struct.pack("<Q", 1) + struct.pack("<I", 7)
    ).digest()
    assert tail_key(None, [7], NS).digest == no_parent
    doc = hashlib.sha256(
        b"kvfuse.doc\0" + ns_digest + struct.pack("<QI", 1, 2) + struct.pack("<Q3I", 3, 10, 20, 30)
    )
    assert document_key([10, 20, 30], NS, context=[2]).digest == doc.digest()


def test_keys_identical_in_another_process_with_another_hash_seed():
    code = (
        "from kvfuse.kv.keys import *; import numpy as np\n"
        "ns = Namespace('m', 'float16', 'L2xH1xD4', salt='t')\n"
        "print(','.join(str(k) for k in prefix_keys(np.arange(1000) * 7, 64, ns)))\n"
        "print(document_key([5, 6, 7], ns))\n"
    )
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "12345")
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    ns = Namespace("m", "float16", "L2xH1xD4", salt="t")
    here = (
        ",".join(str(k) for k in prefix_keys(np.arange(1000) * 7, 64, ns))
        + "\n"
        + str(document_key([5, 6, 7], ns))
        + "\n"
    )
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fingerprint", "sha256:abd"),
        ("kv_dtype", "bfloat16"),
        ("kv_layout", "L30xH3xD128"),
        ("format_version", FORMAT_VERSION + 1),
        ("salt", "salt-b"),
        ("tenant", "tenant-b"),
    ],
)
def test_every_namespace_field_changes_every_key(field, value):
    other = dataclasses.replace(NS, **{field: value})
    tokens = list(range(512))
    a, b = prefix_keys(tokens, 256, NS), prefix_keys(tokens, 256, other)
    assert other.short_id() != NS.short_id()
    assert not {str(k) for k in a} & {str(k) for k in b}
    assert str(document_key(tokens, NS)) != str(document_key(tokens, other))


def test_field_boundaries_are_unambiguous():
    # Length prefixes: moving a character from one field to the next must change the digest.
    a = Namespace("ab", "c", "L1xH1xD1")
    b = Namespace("a", "bc", "L1xH1xD1")
    assert a.digest() != b.digest()


def test_prefix_property_and_chain_dependence():
    tokens = np.arange(5 * 16, dtype=np.int64) % 97
    long_keys = prefix_keys(tokens, 16, NS)
    for k in range(1, 5):
        assert prefix_keys(tokens[: k * 16], 16, NS) == long_keys[:k]
    changed = tokens.copy()
    changed[3] += 1  # a change in chunk 0 changes every later key too
    assert all(x != y for x, y in zip(prefix_keys(changed, 16, NS), long_keys))
    later = tokens.copy()
    later[40] += 1  # a change in chunk 2 leaves chunks 0 and 1 alone
    assert (
        prefix_keys(later, 16, NS)[:2] == long_keys[:2]
        and prefix_keys(later, 16, NS)[2] != long_keys[2]
    )


def test_only_full_chunks_get_keys():
    assert len(prefix_keys(list(range(600)), 256, NS)) == 2
    assert prefix_keys(list(range(255)), 256, NS) == []
    assert prefix_keys([], 256, NS) == []
    # The tail does not influence the full chunks' keys.
    assert prefix_keys(list(range(512)) + [1, 2], 256, NS) == prefix_keys(list(range(512)), 256, NS)
    assert chunk_spans(600, 256) == [(0, 256), (256, 512)]
    assert chunk_spans(0, 4) == []


def test_input_types_give_the_same_keys():
    ref = prefix_keys(list(range(64)), 32, NS)
    assert prefix_keys(np.arange(64, dtype=np.uint32), 32, NS) == ref
    assert prefix_keys(np.arange(64, dtype=np.int64), 32, NS) == ref
    assert prefix_keys(torch.arange(64), 32, NS) == ref
    assert prefix_keys(range(64), 32, NS) == ref


def test_tail_keys_follow_their_parent_chain_and_differ_from_other_kinds():
    tokens = list(range(40))
    keys = prefix_keys(tokens, 16, NS)
    tail = tail_key(keys[-1], tokens[32:], NS)
    assert tail.kind is ChunkKind.TAIL and ChunkKey.parse(str(tail)) == tail
    assert tail_key(keys[-1], tokens[32:], NS) == tail  # deterministic
    assert tail_key(keys[0], tokens[32:], NS) != tail  # another history, another key
    assert tail_key(keys[-1], tokens[32:39], NS) != tail  # a shorter tail is not the same entry
    other = dataclasses.replace(NS, salt="x")
    assert tail_key(prefix_keys(tokens, 16, other)[-1], tokens[32:], other) != tail
    assert tail.digest != document_key(tokens[32:], NS).digest
    with pytest.raises(ValueError, match="no tokens"):
        tail_key(keys[-1], [], NS)
    with pytest.raises(ValueError, match="parent"):
        tail_key(document_key(tokens, NS), [1], NS)
    with pytest.raises(ValueError, match="parent"):
        tail_key(keys[0], [1], other)


def test_document_keys_never_equal_prefix_keys():
    tokens = list(range(256))
    doc = document_key(tokens, NS)
    pre = prefix_keys(tokens, 256, NS)[0]
    assert doc.kind is ChunkKind.DOCUMENT and pre.kind is ChunkKind.PREFIX
    assert doc.digest != pre.digest and str(doc) != str(pre)
    assert document_key(tokens, NS) == doc
    assert document_key(tokens[:-1], NS) != doc
    # KV computed behind another context: another entry
    assert document_key(tokens, NS, context=[1]) != doc
    # no ambiguity
    assert document_key(tokens[1:], NS, context=tokens[:1]) != document_key(tokens, NS)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1],
        [2**32],
        [1.5, 2.0],
        np.array([1.0, 2.0]),
        [[1, 2], [3, 4]],
        ["a"],
        [True, False],
        [2**70],
    ],
)
def test_bad_tokens_rejected(tokens):
    with pytest.raises(ValueError):
        prefix_keys(tokens, 1, NS)


@pytest.mark.parametrize("chunk", [0, -4, 2.0])
def test_bad_chunk_size_rejected(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        prefix_keys([1, 2, 3, 4], chunk, NS)


def test_empty_document_rejected():
    with pytest.raises(ValueError, match="no tokens"):
        document_key([], NS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_fingerprint": ""},
        {"kv_layout": ""},
        {"format_version": -1},
        {"format_version": 2**32},
        {"salt": None},
    ],
)
def test_bad_namespace_rejected(kwargs):
    with pytest.raises(ValueError):
        dataclasses.replace(NS, **kwargs)


def test_chunk_key_string_round_trip_and_parse_errors():
    key = prefix_keys(range(4), 4, NS)[0]
    assert ChunkKey.parse(str(key)) == key
    doc = document_key([1], NS)
    assert ChunkKey.parse(str(doc)) == doc
    s = str(key)
    for bad in [
        "",
        s + "0",
        s[:-1],
        s.upper(),
        s.replace(":p:", ":x:"),
        s.replace(":", "/"),
        "zz" + s[2:],
        s + ":p",
    ]:
        with pytest.raises(ValueError):
            ChunkKey.parse(bad)
    with pytest.raises(ValueError):
        ChunkKey.parse(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ChunkKey("short", b"\0" * 32, ChunkKind.PREFIX)
    with pytest.raises(ValueError):
        ChunkKey("0" * 48, b"\0" * 31, ChunkKind.PREFIX)
    with pytest.raises(ValueError):
        ChunkKey("0" * 48, b"\0" * 32, False)  # a kind, not a bool
    with pytest.raises(ValueError):  # key version 2's 24 hex chars: never read as a key now
        ChunkKey("0" * 24, b"\0" * 32, ChunkKind.PREFIX)
    with pytest.raises(ValueError):
        ChunkKey.parse("0" * 24 + ":p:" + "0" * 64)


def test_tenant_tag_prefixes_every_namespace_of_a_tenant():
    from kvfuse.kv.keys import tenant_tag

    a1 = dataclasses.replace(NS, tenant="alice", salt="s1")
    a2 = dataclasses.replace(NS, tenant="alice", kv_dtype="bfloat16")
    b = dataclasses.replace(NS, tenant="bob", salt="s1")
    tag = tenant_tag("alice")
    assert len(tag) == 16 and tag != tenant_tag("bob") and tag != tenant_tag("")
    assert all(str(k).startswith(tag) for ns in (a1, a2) for k in prefix_keys(range(8), 4, ns))
    assert not any(str(k).startswith(tag) for k in prefix_keys(range(8), 4, b))
    assert a1.short_id() != a2.short_id()  # one tenant, several namespaces


def test_salt_prefix_covers_every_namespace_derived_from_the_salt():
    """A request salt's tag follows the tenant's in every namespace derived from it (the
    deployment's salt, blend settings, a history: all in ``salt``), for every model: deleting by
    ``salt_prefix`` covers them and nothing of another salt or tenant."""
    from kvfuse.kv.keys import salt_prefix, tenant_tag

    x = dataclasses.replace(NS, tenant="alice", salt="x", cache_salt="x")
    derived = [
        x,
        dataclasses.replace(x, salt="x\0blend:0.15"),
        dataclasses.replace(x, salt="x\0history:abcd"),
        dataclasses.replace(x, salt="deploy\0x", model_fingerprint="sha256:other"),
    ]
    others = [
        dataclasses.replace(x, cache_salt="y", salt="y"),
        dataclasses.replace(x, cache_salt="", salt=""),
        dataclasses.replace(x, tenant="bob"),
    ]
    prefix = salt_prefix("alice", "x")
    assert len(prefix) == 32 and prefix.startswith(tenant_tag("alice"))
    assert len({ns.short_id() for ns in derived}) == len(derived)  # still distinct namespaces
    assert all(str(k).startswith(prefix) for ns in derived for k in prefix_keys(range(8), 4, ns))
    assert not any(ns.short_id().startswith(prefix) for ns in others)
    assert salt_prefix("alice", "x") != salt_prefix("bob", "x")  # a salt is the tenant's own


def test_key_prefix_and_layout():
    assert NS.key_prefix() == NS.short_id() + ":" and len(NS.short_id()) == 48
    assert all(str(k).startswith(NS.key_prefix()) for k in prefix_keys(range(8), 4, NS))
    assert layout_of(30, 3, 64) == "L30xH3xD64"
    with pytest.raises(ValueError):
        layout_of(0, 3, 64)
