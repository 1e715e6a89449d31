"""KV events without a model: block hashes, the tracker's events, vLLM's wire format, the ZMQ
publisher (live stream, replay, drops), the tier hooks, and the configuration's checks."""

from __future__ import annotations

import time

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvfuse.config import ConfigError, load_config  # noqa: E402
from kvfuse.events.blocks import Span, chunk_blocks, hash_int  # noqa: E402
from kvfuse.events.hub import KVEvents, medium_of  # noqa: E402
from kvfuse.events.publisher import Inbox, Publisher, PublisherStats  # noqa: E402
from kvfuse.events.tracker import TierMedium, Tracker  # noqa: E402
from kvfuse.events.wire import (  # noqa: E402
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from kvfuse.kv.keys import ChunkKind, Namespace, prefix_keys, tail_key  # noqa: E402
from kvfuse.tiers.memory import MemoryTier  # noqa: E402
from kvfuse_testkit import free_port  # noqa: E402

CH, BS = 32, 8
NS = Namespace("model-x", "float16", "layout-a", tenant="alice")
OTHER = Namespace("model-x", "float16", "layout-a", tenant="bob")
IDS = list(range(100, 100 + 3 * CH + 10))  # three full chunks and a 10-token tail


def spans(ids=IDS, ns=NS):
    keys = prefix_keys(ids, CH, ns)
    out = [Span(k, i * CH, (i + 1) * CH) for i, k in enumerate(keys)]
    start = len(keys) * CH
    if start < len(ids):
        out.append(Span(tail_key(keys[-1] if keys else None, ids[start:], ns), start, len(ids)))
    return out


def tracker(capacity=100):
    return Tracker([TierMedium("CPU"), TierMedium("REDIS", "redis")], BS, CH, capacity)


# -- block hashes ------------------------------------------------------------------------------


def test_blocks_chain_through_chunks_and_tails():
    sp = spans()
    keys = [s.key for s in sp]
    first = chunk_blocks(keys[0], None, IDS[:CH], BS, CH)
    second = chunk_blocks(keys[1], keys[0], IDS[CH : 2 * CH], BS, CH)
    assert first.count == CH // BS and first.parent is None
    assert first.hashes[-1] == hash_int(keys[0].digest) == second.parent
    assert len(set(first.hashes + second.hashes)) == 2 * CH // BS
    assert all(0 <= h < 2**63 for h in first.hashes)
    tail = chunk_blocks(keys[3], keys[2], IDS[3 * CH :], BS, CH)
    assert tail.count == 1  # 10 tokens: one whole block of 8, the rest never announced
    # a tail over the first 20 tokens shares its whole blocks' hashes with the full chunk
    early = chunk_blocks(tail_key(None, IDS[:20], NS), None, IDS[:20], BS, CH)
    assert early.hashes == first.hashes[:2]


def test_tenants_never_share_a_hash():
    a = chunk_blocks(spans()[0].key, None, IDS[:CH], BS, CH)
    b = chunk_blocks(spans(ns=OTHER)[0].key, None, IDS[:CH], BS, CH)
    assert not set(a.hashes) & set(b.hashes)


def test_block_size_must_divide_the_chunk():
    with pytest.raises(ValueError, match="must divide"):
        chunk_blocks(spans()[0].key, None, IDS[:CH], 7, CH)


# -- the tracker -------------------------------------------------------------------------------


def test_stored_once_per_tier_with_tokens_parent_and_namespace():
    t, sp = tracker(), spans()
    assert t.describe(NS, IDS, sp) == []
    (ev,) = t.stored(0, sp[1].key)
    assert isinstance(ev, BlockStored) and ev.medium == "CPU" and ev.ownership is None
    assert ev.token_ids == IDS[CH : 2 * CH] and ev.block_size == BS
    assert ev.parent_block_hash == hash_int(sp[0].key.digest)
    assert ev.extra_keys == [(sp[1].key.namespace_id,)] * (CH // BS)
    assert t.stored(0, sp[1].key) == []  # already announced there
    (shared,) = t.stored(1, sp[1].key)
    assert shared.medium == "REDIS" and shared.ownership == "redis"
    (tail,) = t.stored(0, sp[3].key)
    assert tail.token_ids == IDS[3 * CH : 3 * CH + BS]  # whole blocks only


def test_untracked_chunks_make_no_events():
    t = tracker()
    assert t.stored(0, spans()[0].key) == [] and t.stats.untracked == 1
    assert t.removed(0, spans()[0].key) == []


def test_removed_and_forgotten_retract_what_was_announced():
    t, sp = tracker(capacity=2), spans()
    t.describe(NS, IDS, sp[:2])
    stored = t.stored(0, sp[0].key)[0]
    (gone,) = t.removed(0, sp[0].key)
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == stored.block_hashes
    assert t.removed(0, sp[0].key) == []  # no longer known
    t.describe(NS, IDS, sp[:2])
    t.stored(1, sp[0].key)
    events = t.describe(NS, IDS, sp[2:4])  # over capacity: the oldest two go
    assert [type(e) for e in events] == [BlockRemoved]  # only sp[0] had been announced
    assert events[0].medium == "REDIS" and len(t) == 2 and t.stats.forgotten == 2


def test_overlapping_chunks_retract_only_blocks_no_other_holds():
    t, sp = tracker(), spans()
    short, longer = IDS[:12], IDS[:20]  # a prompt's tail (1 block), the turn's tail (2 blocks)
    keys = [tail_key(None, short, NS), tail_key(None, longer, NS)]
    t.describe(NS, IDS, [Span(keys[0], 0, 12), Span(keys[1], 0, 20), sp[0]])
    tails = [t.stored(0, k)[0] for k in keys]
    (chunk,) = t.stored(0, sp[0].key)
    assert tails[1].block_hashes == chunk.block_hashes[:2]
    t.stored(1, keys[0])
    assert t.removed(0, keys[0]) == []  # its block is the longer tail's and the chunk's too
    (redis,) = t.removed(1, keys[0])  # nothing else was announced in Redis
    assert redis.block_hashes == tails[0].block_hashes and redis.medium == "REDIS"
    (gone,) = t.removed(0, sp[0].key)  # the longer tail still holds the first two
    assert gone.block_hashes == chunk.block_hashes[2:]
    (last,) = t.freed([keys[1]])
    assert last.block_hashes == tails[1].block_hashes and len(t) == 0


def test_cleared_and_freed():
    t, sp = tracker(), spans()
    t.describe(NS, IDS, sp)
    other = spans(ns=OTHER)
    t.describe(OTHER, IDS, other)
    for s in sp + other[:1]:
        t.stored(0, s.key)
    tenant = str(sp[0].key).split(":")[0]
    only_alice = t.cleared(str(sp[0].key)[: len(tenant)])
    assert not any(isinstance(e, AllBlocksCleared) for e in only_alice)  # bob's blocks stay
    assert len(only_alice) == len(sp)
    (freed,) = t.freed([other[0].key])
    assert isinstance(freed, BlockRemoved)
    t.describe(NS, IDS, sp)
    t.stored(0, sp[0].key)
    everything = t.cleared("")
    assert isinstance(everything[0], AllBlocksCleared) and len(everything) == 2


# -- the wire ----------------------------------------------------------------------------------


def test_batches_are_arrays_and_events_tagged_maps():
    ev = BlockStored([1, 2], None, [5] * 16, 8, None, "CPU", None, extra_keys=[("n",), ("n",)])
    payload = encode_batch(12.5, [ev, BlockRemoved([1], "CPU"), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 12.5 and raw[2] is None  # [ts, events, data_parallel_rank] (as vLLM's)
    stored, removed, cleared = raw[1]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert "ownership" not in stored  # defaults are left out
    assert removed == {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(payload).events[0] == ev


# -- the publisher -----------------------------------------------------------------------------


def test_inbox_drops_and_counts_when_full():
    stats = PublisherStats()
    inbox = Inbox(2, stats)
    assert [inbox.offer((i,)) for i in range(3)] == [True, True, False]
    assert stats.queue_drops == 1 and inbox.take() == [(0,), (1,)]


def _subscriber(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def test_publisher_streams_batches_in_order_and_replays():
    port, replay_port = free_port(), free_port()
    pub = Publisher(
        tracker(),
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{replay_port}",
        topic="kv@test",
    )
    events = KVEvents(pub)
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 5
        while pub.stats.subscribers < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the subscription reaches the XPUB socket
        sp = spans()
        events.describe(NS, IDS, sp)
        obs = events.observer(0)
        for s in sp:
            obs.stored(s.key)
        obs.stored(spans()[0].key)  # already announced: no second event
        events.cleared("")
        got, seqs = [], []
        while len(got) < len(sp) + 1 + len(sp):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@test" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            got += decode_batch(payload).events
        assert seqs == list(range(len(seqs)))
        kinds = [type(e).__name__ for e in got]
        assert kinds == ["BlockStored"] * 4 + ["AllBlocksCleared"] + ["BlockRemoved"] * 4
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append(int.from_bytes(seq, "big"))
        assert replayed == seqs[1:]
        assert events.counters()["replays"] == 1
    finally:
        events.close()
        ctx.destroy(linger=0)


def test_a_taken_port_is_an_error_at_start():
    port = free_port()
    first = Publisher(tracker(), f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(OSError, match="cannot bind"):
            Publisher(tracker(), f"tcp://127.0.0.1:{port}")
    finally:
        first.close()


# -- the tier hooks ----------------------------------------------------------------------------


class _Offers(list):
    def offer(self, item):
        self.append(item)
        return True


def test_memory_tier_reports_prefix_chunks_only_and_evictions():
    offers = _Offers()
    tier = MemoryTier(capacity_bytes=100)
    hub = KVEvents.__new__(KVEvents)  # no publisher: only its observer factory is used
    hub._offer = offers.offer
    tier.observer = hub.observer(0)
    sp = spans()
    tier.put(sp[0].key, b"x" * 60)
    tier.put(sp[0].key, b"y" * 60)  # replaced: stored again, never removed
    tier.put(sp[1].key, b"z" * 60)  # evicts sp[0]
    doc = sp[2].key.__class__(sp[2].key.namespace_id, sp[2].key.digest, ChunkKind.DOCUMENT)
    tier.put(doc, b"d")  # never announced
    assert offers == [
        ("stored", 0, sp[0].key),
        ("stored", 0, sp[0].key),
        ("removed", 0, sp[0].key),
        ("stored", 0, sp[1].key),
    ]
    assert medium_of(tier) == ("CPU", None)


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "server, message",
    [
        ({"kv_events": "http://x:1"}, "must be a ZMQ endpoint"),
        ({"kv_events": "tcp://*:70000"}, "port must be in"),
        ({"kv_events_replay": "tcp://*:5558"}, "needs server.kv_events"),
        ({"kv_events": "tcp://*:5557", "kv_events_block_size": 24}, "must divide cache.chunk_size"),
        ({"kv_events": "tcp://*:5557", "kv_events_queue": 0}, "must be >= 1"),
        ({"owned_by": " "}, "must not be empty"),
    ],
)
def test_config_checks(tmp_path, server, message):
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"server": server}))
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_config_accepts_an_endpoint(tmp_path):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"server": {"kv_events": "tcp://*:5557"}}))
    c = load_config(str(path))
    assert c.server.kv_events == "tcp://*:5557" and c.server.kv_events_block_size == 16


def test_missing_extra_is_named(monkeypatch):
    from kvfuse.events import hub

    monkeypatch.setitem(__import__("sys").modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(
        RuntimeError, match=r"server.kv_events needs zmq: pip install 'kvfuse\[events\]'"
    ):
        hub._import_wire()
