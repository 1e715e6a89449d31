"""The Redis tier on a real Redis Cluster (three redis-server processes, ``redis-cli --cluster
create``): keys spread over the nodes, batched operations split per node, expiry, and two
``kvfuse serve`` processes sharing the cluster reusing each other's entries."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from openai import OpenAI

from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.tiers import RedisTier
from kvfuse_testkit import LocalRedisCluster, ServerProcess, ensure_model

pytestmark = pytest.mark.integration

KEYS = prefix_keys(list(range(16 * 24)), 16, Namespace("model", "float16", "L2"))  # 24 keys


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed: apt-get install -y redis-server")
    c = LocalRedisCluster(3).start()
    try:
        yield c
    finally:
        c.close()


def keys_per_node(cluster) -> list[int]:
    return [
        int(
            subprocess.run(
                [cluster.cli, "-p", str(s.port), "dbsize"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
        for s in cluster.servers
    ]


def test_a_cluster_tier_spreads_keys_and_batches_per_node(cluster):
    tier = RedisTier(cluster.url, cluster=True, key_prefix="t1:")
    now = [time.time()]
    tier.clock = lambda: now[0]
    try:
        values = [bytes([i]) * (100 + i) for i in range(len(KEYS))]
        tier.put_many(list(zip(KEYS, values)))
        per_node = keys_per_node(cluster)
        assert sum(per_node) == len(KEYS) and sum(n > 0 for n in per_node) == 3, per_node
        assert tier.get_many(KEYS) == values  # one MGET per slot, back in key order
        assert tier.contains_many(
            KEYS + [prefix_keys(list(range(16)), 16, Namespace("x", "float16", "L2"))[0]]
        ) == [True] * len(KEYS) + [False]
        assert tier.read_range(KEYS[5], 10, 20) == values[5][10:20]
        tier.put(KEYS[0], b"short", expires_at=now[0] + 60)
        assert 55 < tier.expiry(KEYS[0]) - now[0] <= 60 and tier.expiry(KEYS[1]) is None
        assert tier.extend_many(KEYS[:2], now[0] + 600) == [True, True]
        # no TTL: left alone
        assert tier.expiry(KEYS[0]) - now[0] > 590 and tier.expiry(KEYS[1]) is None
        assert tier.delete_many(KEYS[:4]) == 4
        assert tier.delete_prefix("") == len(KEYS) - 4 and sum(keys_per_node(cluster)) == 0
        assert tier.stats.snapshot()["errors"] == 0
    finally:
        tier.close()


def test_a_dead_cluster_at_start_up_is_a_miss_not_a_crash():
    from kvfuse_testkit import free_port

    tier = RedisTier(
        f"redis://127.0.0.1:{free_port()}/0", cluster=True, timeout_s=0.2, backoff_s=0.2
    )
    try:
        assert tier.get(KEYS[0]) is None and not tier.contains(KEYS[0])
        tier.put(KEYS[0], b"x")
        s = tier.stats.snapshot()
        assert s["errors"] >= 1 and s["dropped_writes"] >= 1
    finally:
        tier.close()


def test_two_servers_share_entries_through_the_cluster(cluster, kvfuse_home):
    from kvfuse_helpers import long_text

    ensure_model(kvfuse_home, "smollm2")
    config = {
        "model": "smollm2",
        "cache": {"redis_url": cluster.url, "redis_cluster": True, "disk": False},
    }
    a, b = ServerProcess(kvfuse_home, config=config), ServerProcess(kvfuse_home, config=config)
    a.start()
    try:
        b.start()
        prompt = long_text(6) + "\n\nQuestion: what is the first paragraph about?\nAnswer:"

        def ask(server) -> int:
            c = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
            r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
            return (
                r.usage.prompt_tokens_details.cached_tokens,
                r.usage.prompt_tokens_details.model_extra,
                r.choices[0].text,
            )

        cached, _, text_a = ask(a)
        assert cached == 0
        deadline = time.monotonic() + 30
        # A's background writes
        while sum(keys_per_node(cluster)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        cached, details, text_b = ask(b)  # another process: its memory tier is empty
        assert cached >= 512 and details["cached_entries_by_tier"].get("redis", 0) >= 2
        assert text_b == text_a
    finally:
        b.close()
        a.close()
