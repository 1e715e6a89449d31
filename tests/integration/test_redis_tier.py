"""RedisTier against a real redis-server: round trips, pipelines, outages, slowness, recovery, sharing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from keyed import K, Ks, ns_prefix

from kvfuse.tiers import RedisTier

pytestmark = pytest.mark.integration

TIMEOUT, BACKOFF = 0.3, 0.4


def _tier(server, **kw) -> RedisTier:
    return RedisTier(server.url, **{"timeout_s": TIMEOUT, "backoff_s": BACKOFF, **kw})


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_round_trip_stats_and_prefix(redis_server):
    t = _tier(redis_server)
    value = os.urandom(100_000)
    t.put(K("1"), value)
    assert t.contains(K("1")) and t.get(K("1")) == value
    assert t.get(K("2")) is None and not t.contains(K("2"))
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get(f"kvfuse:{K('1')}") == value  # stored under the key prefix
    s = t.stats.snapshot()
    assert (s["puts"], s["bytes_in"], s["hits"], s["misses"], s["bytes_out"], s["errors"]) == (
        1,
        100_000,
        1,
        1,
        100_000,
        0,
    )
    assert t.delete(K("1")) and not t.delete(K("1")) and t.get(K("1")) is None
    t.put_many([(K("mv"), memoryview(value)), (K("ba"), bytearray(b"abc"))])  # any bytes-like value
    assert t.get_many(Ks("mv", "ba")) == [value, b"abc"]
    assert t.read_range(K("mv"), 10, 20) == value[10:20] and t.read_range(K("ba"), 1, 99) == b"bc"
    assert t.read_range(K("nope"), 0, 5) is None
    with pytest.raises(TypeError, match="ChunkKey"):
        t.put("ns:p:1", value)


def test_batched_pipeline(redis_server):
    t = _tier(redis_server)
    items = [(K(f"k{i}"), os.urandom(1000 + i)) for i in range(50)]
    t.put_many(items)
    keys = [k for k, _ in items]
    asked = keys[::2] + [K("missing")] + keys[1::2]
    expected = [v for _, v in items[::2]] + [None] + [v for _, v in items[1::2]]
    assert t.get_many(asked) == expected
    assert t.contains_many(Ks("missing", "k3", "k49")) == [False, True, True]
    assert t.get_many([]) == [] and t.contains_many([]) == []
    assert t.stats.snapshot()["puts"] == 50


def test_ttl_expires_entries(redis_server):
    t = _tier(redis_server, ttl_s=0.2)
    t.put(K("k"), b"v")
    assert t.get(K("k")) == b"v"
    time.sleep(0.35)
    assert t.get(K("k")) is None


def test_delete_prefix_scans_only_the_prefix_literally(redis_server):
    t, other = _tier(redis_server), _tier(redis_server, key_prefix="other:")
    # a key prefix with glob characters, taken literally
    glob = _tier(redis_server, key_prefix="a*")
    near = _tier(redis_server, key_prefix="ab")
    a1, a2 = K("1", "a"), K("2", "a")
    glob.put_many([(a1, b"1"), (a2, b"2")])
    near.put(a1, b"3")
    t.put_many([(K(f"{i}", "n"), b"x") for i in range(2500)] + [(K("x", "m"), b"m")])
    other.put(a1, b"kept")
    assert glob.delete_prefix("") == 2  # '*' is a literal here, not a glob: "ab..." stays
    assert glob.get_many([a1, a2]) == [None, None] and near.get(a1) == b"3"
    assert t.delete_prefix(ns_prefix("n")) == 2500  # several SCAN / UNLINK batches
    assert t.clear() == 1 and other.get(a1) == b"kept" and near.get(a1) == b"3"


def test_server_down_gives_fast_misses_dropped_writes_and_recovery(redis_server):
    t = _tier(redis_server)
    t.put(K("k"), b"v")
    assert t.get(K("k")) == b"v"
    redis_server.stop()
    value, took = _timed(t.get, K("k"))
    assert value is None and took < TIMEOUT + 0.2
    assert t.is_backing_off()
    # During the back-off nothing touches the network: answers are immediate.
    (_, took_put), (miss, took_get) = (
        _timed(t.put, K("k2"), b"v2"),
        _timed(t.get_many, Ks("k", "k2")),
    )
    assert miss == [None, None] and took_put < 0.01 and took_get < 0.01
    assert t.contains_many(Ks("k")) == [False] and t.delete_prefix("") == 0
    s = t.stats.snapshot()
    assert s["errors"] == 1 and s["dropped_writes"] == 1 and s["misses"] == 3
    redis_server.start()
    time.sleep(BACKOFF + 0.05)
    assert not t.is_backing_off()
    t.put(K("k3"), b"v3")  # the server restarted empty; the tier reconnects by itself
    assert t.get(K("k3")) == b"v3" and t.get(K("k")) is None
    assert t.stats.snapshot()["errors"] == 1


def test_calls_while_the_server_is_down_fail_within_the_timeout(redis_server):
    t = _tier(redis_server, backoff_s=0.0)  # no back-off: every call tries the network
    redis_server.stop()
    for fn, args in [
        (t.get, (K("k"),)),
        (t.put, (K("k"), b"v")),
        (t.contains, (K("k"),)),
        (t.delete_prefix, ("",)),
    ]:
        _, took = _timed(fn, *args)
        assert took < TIMEOUT + 0.2, fn
    assert t.stats.snapshot()["errors"] == 4


def test_a_hung_server_times_out_then_recovers(redis_server):
    t = _tier(redis_server)
    t.put(K("k"), b"v" * 1000)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # alive but not answering
    try:
        value, took = _timed(t.get, K("k"))
        assert value is None and TIMEOUT * 0.8 < took < TIMEOUT + 0.3
        _, took = _timed(t.put, K("k2"), b"x")  # in back-off: dropped at once
        assert took < 0.01
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    time.sleep(BACKOFF + 0.05)
    assert t.get(K("k")) == b"v" * 1000
    s = t.stats.snapshot()
    assert s["errors"] == 1 and s["dropped_writes"] == 1


def test_unreachable_from_the_start_is_not_an_exception():
    t = RedisTier("redis://127.0.0.1:1/0", timeout_s=0.2, backoff_s=0.1)
    assert (
        t.get(K("k")) is None and t.put(K("k"), b"v") is None and t.stats.snapshot()["errors"] == 1
    )
    t.close()


def test_bad_configuration():
    with pytest.raises(ValueError, match="URL"):
        RedisTier("http://nope")
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1", timeout_s=0)


_CHILD = """
import sys
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers import RedisTier
t = RedisTier(sys.argv[1], timeout_s=2)
t.put(ChunkKey.parse(sys.argv[2]), b"child-value")
print(t.get(ChunkKey.parse(sys.argv[3])).decode())
"""


def test_two_processes_share_entries(redis_server):
    t = _tier(redis_server)
    t.put(K("from-parent"), b"parent-value")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            redis_server.url,
            str(K("from-child")),
            str(K("from-parent")),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "parent-value"
    assert t.get(K("from-child")) == b"child-value"


def test_an_entry_round_trips_as_its_joined_bytes(redis_server):
    import torch

    from kvfuse.codecs import get_codec
    from kvfuse.kv.chunk import KVChunk
    from kvfuse.kv.format import decode_chunk, encode_entry

    chunk = KVChunk(kv=torch.randn(2, 2, 16, 1, 8), positions=torch.arange(16))
    t = _tier(redis_server)
    entry = encode_entry(chunk, K("e"), get_codec("raw"))
    t.put(K("e"), entry)
    got = t.get(K("e"))
    assert got == entry.join() and torch.equal(decode_chunk(got, K("e")).kv, chunk.kv)
    assert t.stats.snapshot()["bytes_in"] == len(entry)


def test_keys_lists_entries_and_variants_and_skips_foreign_keys(redis_server):
    t = _tier(redis_server)
    t.put_many([(K("a"), b"1"), (K("a").encoded_as("cachegen", 1), b"2"), (K("b"), b"3")])
    raw = redis.Redis.from_url(redis_server.url)
    raw.set("kvfuse:not-a-chunk-key", b"x")  # under our prefix, but not one of ours: skipped
    raw.set("other:" + str(K("c")), b"x")  # another prefix: never listed
    assert set(t.keys()) == {K("a"), K("a").encoded_as("cachegen", 1), K("b")}
    assert len(t.keys(limit=2)) == 2


# -- expiry (retention): Redis's own, on its real clock ------------------------------------------


def _pttl(raw, key) -> int:
    return raw.pttl(f"kvfuse:{key}")


def test_an_expiry_is_a_native_ttl_converted_from_the_tiers_clock(redis_server):
    t = _tier(redis_server)
    t.clock = lambda: 1000.0  # a fake clock: a time on it becomes the time left, at the call
    raw = redis.Redis.from_url(redis_server.url)
    a, b, c, n = Ks("a", "b", "c", "n")
    t.put(a, b"v", expires_at=1030.0)
    t.put_many([(b, b"v"), (c, b"v")], expires_at=1060.0)
    t.put(n, b"v")
    assert (
        29_000 < _pttl(raw, a) <= 30_000
        and 59_000 < _pttl(raw, b) <= 60_000
        and 59_000 < _pttl(raw, c) <= 60_000
    )
    assert _pttl(raw, n) == -1
    got = t.expiries([a, b, n, K("missing")])
    assert 1029 < got[0] <= 1030 and 1059 < got[1] <= 1060 and got[2:] == [None, None]
    assert t.expiry(a) == pytest.approx(1030, abs=1)
    t.put(a, b"v2")  # a put replaces the expiry too
    assert _pttl(raw, a) == -1 and t.expiry(a) is None
    t.put(b, b"new", expires_at=1000.0)  # passed already: nothing stored, the older value removed
    assert t.get(b) is None and not raw.exists(f"kvfuse:{b}") and t.get(c) == b"v"
    assert t.expire() == 0 and t.stats.snapshot()["expired"] == 0  # Redis expires by itself
    assert t.stats.snapshot()["errors"] == 0


def test_the_tiers_own_ttl_caps_an_expiry(redis_server):
    t = _tier(redis_server, ttl_s=10)
    raw = redis.Redis.from_url(redis_server.url)
    t.put(K("long"), b"v", expires_at=t.clock() + 100)
    t.put(K("short"), b"v", expires_at=t.clock() + 5)
    assert 9_000 < _pttl(raw, K("long")) <= 10_000 and 4_000 < _pttl(raw, K("short")) <= 5_000


def test_extend_only_lengthens_a_ttl(redis_server):
    t = _tier(redis_server)
    t.clock = lambda: 1000.0
    raw = redis.Redis.from_url(redis_server.url)
    a, b, n = Ks("a", "b", "n")
    t.put(a, b"v", expires_at=1010.0)
    t.put(b, b"v", expires_at=1100.0)
    t.put(n, b"v")
    assert t.extend_many([K("missing"), a, b, n], 1050.0) == [False, True, True, True]
    assert 49_000 < _pttl(raw, a) <= 50_000  # moved later
    assert 99_000 < _pttl(raw, b) <= 100_000  # never shortened (GT)
    assert _pttl(raw, n) == -1  # no TTL: left alone, it lives longer already
    # a time passed: no change
    assert t.extend(K("missing"), 1050.0) is False and t.extend(a, 900.0) is True
    assert 49_000 < _pttl(raw, a) <= 50_000


def test_entries_expire_on_the_servers_own_clock(redis_server):
    t = _tier(redis_server)
    t.put(K("a"), b"v", expires_at=time.time() + 0.3)
    t.put(K("b"), b"v")
    assert t.get(K("a")) == b"v"
    time.sleep(1.0)
    assert t.get(K("a")) is None and not t.contains(K("a")) and t.read_range(K("a"), 0, 1) is None
    assert t.get(K("b")) == b"v" and t.expiry(K("a")) is None


def test_expiry_calls_while_the_server_is_down_are_misses(redis_server):
    t = _tier(redis_server)
    t.put(K("a"), b"v", expires_at=time.time() + 60)
    redis_server.stop()
    assert t.expiries([K("a")]) == [None] and t.is_backing_off()
    (got, took) = _timed(t.extend_many, [K("a")], time.time() + 100)
    assert got == [False] and took < 0.01  # in back-off: no network
    assert t.delete_many([K("a")]) == 0


def test_a_store_carries_expiries_to_redis_promotes_extends_and_deletes(redis_server):
    import torch

    from kvfuse.codecs import get_codec
    from kvfuse.kv.chunk import KVChunk
    from kvfuse.kv.format import encode_chunk
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    def blob(key):
        return encode_chunk(
            KVChunk(torch.randn(2, 2, 4, 2, 8).half(), torch.arange(4)), key, get_codec("raw")
        )

    raw = redis.Redis.from_url(redis_server.url)
    mem, r = MemoryTier(10**6), _tier(redis_server)
    with TieredStore(mem, [r], clock=lambda: 1000.0, stream_levels=(1,)) as store:
        a, b = Ks("a", "b")
        store.put([(a, blob(a)), (b, blob(b))], expires_at=1030.0)
        store.flush()
        variant = a.encoded_as("cachegen", 1)
        assert 29_000 < _pttl(raw, a) <= 30_000 and 29_000 < _pttl(raw, variant) <= 30_000
        mem.clear()
        assert [f.tier for f in store.fetch([a])] == ["redis"]
        assert mem.expiry(a) == pytest.approx(1030, abs=1)  # the promoted copy keeps the expiry
        store.extend([a], 1100.0)
        assert 99_000 < _pttl(raw, a) <= 100_000 and 99_000 < _pttl(raw, variant) <= 100_000
        assert mem.expiry(a) == 1100.0
        assert store.delete([a]) == {"memory": 1, "redis": 2}
        assert (
            not raw.exists(f"kvfuse:{a}") and not raw.exists(f"kvfuse:{variant}") and r.contains(b)
        )
