"""Announcing the disk tier's entries at start-up: the key check that rebuilds prefix chains
(``kv.keys.follows``), the chains themselves, the tracker's ``found`` (the same hashes as when
the chunk was described by its request), and the scan over a real disk tier."""

from __future__ import annotations

import types

import pytest
import torch

from kvfuse.codecs import get_codec
from kvfuse.events.blocks import Span
from kvfuse.events.publisher import Inbox, PublisherStats
from kvfuse.events.startup import Found, StartupAnnouncer, chains, read_found
from kvfuse.events.tracker import TierMedium, Tracker
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_chunk
from kvfuse.kv.keys import ChunkKind, Namespace, document_key, follows, prefix_keys, tail_key
from kvfuse.tiers import DiskTier

CH, BS = 32, 8
NS = Namespace("model-x", "float16", "layout-a", tenant="alice")
OTHER = Namespace("model-x", "float16", "layout-a", tenant="bob")
IDS = list(range(100, 100 + 3 * CH + 10))  # three full chunks and a 10-token tail
KEYS = prefix_keys(IDS, CH, NS)
TAIL = tail_key(KEYS[-1], IDS[3 * CH :], NS)


def chunk(i: int) -> list[int]:
    return IDS[i * CH : (i + 1) * CH]


@pytest.mark.parametrize(
    "parent, child, tokens, expected",
    [
        (KEYS[0], KEYS[1], chunk(1), True),
        (KEYS[1], KEYS[2], chunk(2), True),
        (KEYS[2], TAIL, IDS[3 * CH :], True),
        (KEYS[0], KEYS[2], chunk(2), False),  # not the chunk before
        (KEYS[0], KEYS[1], chunk(2), False),  # other tokens
        (TAIL, KEYS[1], chunk(1), False),  # a tail is nobody's parent
        (prefix_keys(IDS, CH, OTHER)[0], KEYS[1], chunk(1), False),  # another namespace
        (KEYS[0], document_key(chunk(1), NS), chunk(1), False),  # documents do not chain
    ],
)
def test_follows_recomputes_the_childs_key(parent, child, tokens, expected):
    assert follows(parent, child, tokens, CH) is expected


def found_all() -> list[Found]:
    out = [Found(k, i * CH, tuple(chunk(i))) for i, k in enumerate(KEYS)]
    return out + [Found(TAIL, 3 * CH, tuple(IDS[3 * CH :]))]


def test_chains_keep_whole_chains_parents_first():
    got = chains(list(reversed(found_all())), CH)
    assert [(f.key, p) for f, p in got] == [
        (KEYS[0], None), (KEYS[1], KEYS[0]), (KEYS[2], KEYS[1]), (TAIL, KEYS[2])
    ]  # fmt: skip


def test_a_chain_missing_a_link_is_left_out_from_there():
    f = found_all()
    got = chains([f[0], f[2], f[3]], CH)  # chunk 1 evicted: 2 and the tail cannot be matched
    assert [x.key for x, _ in got] == [KEYS[0]]


def test_other_conversations_and_namespaces_are_told_apart():
    other_ids = chunk(0) + [7] * CH  # shares chunk 0, then differs
    k2 = prefix_keys(other_ids, CH, NS)[1]
    bob = prefix_keys(IDS, CH, OTHER)
    found = found_all() + [Found(k2, CH, (7,) * CH), Found(bob[0], 0, tuple(chunk(0))),
                           Found(bob[1], CH, tuple(chunk(1)))]  # fmt: skip
    parent = {f.key: p for f, p in chains(found, CH)}
    assert parent[k2] == KEYS[0] and parent[KEYS[1]] == KEYS[0] and parent[bob[1]] == bob[0]
    assert len(parent) == 7


def test_checks_are_bounded():
    assert len(chains(found_all(), CH, max_checks=1)) == 2  # chunk 0, chunk 1; then it stops


def tracker() -> Tracker:
    return Tracker([TierMedium("CPU"), TierMedium("DISK")], BS, CH, 100)


def test_found_announces_the_hashes_the_request_described():
    live = tracker()
    live.describe(NS, IDS, [Span(k, i * CH, (i + 1) * CH) for i, k in enumerate(KEYS)]
                  + [Span(TAIL, 3 * CH, len(IDS))])  # fmt: skip
    restarted = tracker()
    for f, parent in chains(found_all(), CH):
        assert restarted.found(f.key, parent, f.tokens) == []
    for key in KEYS + [TAIL]:
        (before,) = live.stored(1, key)
        (after,) = restarted.stored(1, key)
        assert after == before and after.medium == "DISK"
    assert restarted.found(KEYS[0], None, chunk(0)) == []  # known already: nothing new


def entry(key, tokens: list[int], start: int) -> bytes:
    kv = torch.zeros((2, 2, len(tokens), 2, 8), dtype=torch.float16)
    c = KVChunk(kv, torch.arange(start, start + len(tokens)))
    return encode_chunk(c, key, get_codec("raw"), token_ids=tokens)


def disk_with_chain(tmp_path) -> DiskTier:
    disk = DiskTier(tmp_path, 10**9)
    for i, k in enumerate(KEYS):
        disk.put(k, entry(k, chunk(i), i * CH))
    disk.put(TAIL, entry(TAIL, IDS[3 * CH :], 3 * CH))
    disk.put(document_key(chunk(0), NS), entry(document_key(chunk(0), NS), chunk(0), 0))
    return disk


def test_read_found_reads_key_position_and_tokens(tmp_path):
    disk = disk_with_chain(tmp_path)
    assert read_found(disk, KEYS[1]) == Found(KEYS[1], CH, tuple(chunk(1)))
    assert read_found(disk, prefix_keys([1] * CH, CH, NS)[0]) is None  # not there


def test_the_scan_offers_each_chained_chunk_found_then_stored(tmp_path):
    disk = disk_with_chain(tmp_path)
    stats = PublisherStats()
    stats.add(subscribers=1)
    offered = []
    publisher = types.SimpleNamespace(
        stats=stats, inbox=Inbox(100, stats), tracker=tracker(), offer=offered.append
    )
    scan = StartupAnnouncer(types.SimpleNamespace(publisher=publisher), disk, 1, limit=100)
    assert scan.wait(timeout=30)
    kinds = [(item[0], item[1]) for item in offered]
    assert len(offered) == 8 and kinds[::2] == [("found", k) for k in KEYS + [TAIL]]
    assert kinds[1::2] == [("stored", 1)] * 4
    assert scan.stats.snapshot()["startup_announced"] == 4
    assert all(item[1].kind is not ChunkKind.DOCUMENT for item in offered if item[0] == "found")
