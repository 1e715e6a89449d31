"""The S3 tier against a real S3-compatible server on 127.0.0.1 (``moto_server``), path-style
addressing, dummy keys and no metadata service: reads and writes, ranged reads, multipart
uploads, concurrent batches, expiry metadata and lifecycle tags, an outage (a miss, never a
failed request, then recovery), and an engine serving a prompt's chunks from S3."""

from __future__ import annotations

import os
import time

import pytest

from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse_testkit import S3_ENV, LocalS3

pytestmark = pytest.mark.integration

boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def s3():
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    try:
        server = LocalS3().start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_tier(s3, prefix: str, **kw):
    from kvfuse.tiers.s3 import S3Tier

    return S3Tier(
        f"s3://kvfuse-test/{prefix}",
        endpoint_url=s3.endpoint_url,
        region="us-east-1",
        create_bucket=True,
        timeout_s=1.0,
        retries=0,
        backoff_s=0.5,
        **kw,
    )


KEYS = prefix_keys(list(range(160)), 16, Namespace("model", "float16", "L2"))  # 10 keys


def test_put_get_contains_range_delete(s3):
    tier = make_tier(s3, "basic/")
    try:
        value = bytes(range(256)) * 40
        assert tier.get(KEYS[0]) is None and not tier.contains(KEYS[0])
        tier.put(KEYS[0], value)
        assert tier.contains(KEYS[0]) and tier.get(KEYS[0]) == value
        assert tier.read_range(KEYS[0], 100, 612) == value[100:612]
        assert tier.read_range(KEYS[0], len(value) - 10, len(value) + 50) == value[-10:]
        tier.put_many([(k, bytes([i]) * 1000) for i, k in enumerate(KEYS[1:5], 1)])
        assert tier.get_many(KEYS[:6]) == [value, *[bytes([i]) * 1000 for i in range(1, 5)], None]
        assert tier.contains_many(KEYS[:6]) == [True] * 5 + [False]
        assert tier.delete(KEYS[0]) and not tier.delete(KEYS[0]) and tier.get(KEYS[0]) is None
        assert tier.delete_many(KEYS[1:3]) == 2
        assert tier.delete_prefix("") == 2 and tier.contains_many(KEYS[:5]) == [False] * 5
        s = tier.stats.snapshot()
        assert s["hits"] >= 7 and s["misses"] >= 2 and s["errors"] == 0 and s["puts"] == 5
    finally:
        tier.close()


def test_multipart_upload_of_a_large_entry(s3):
    tier = make_tier(s3, "multipart/", multipart_bytes=5 * 1024**2)
    try:
        big = os.urandom(11 * 1024**2 + 123)  # three parts
        tier.put(KEYS[0], big)
        client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
        head = client.head_object(Bucket="kvfuse-test", Key="multipart/" + str(KEYS[0]))
        assert head["ETag"].strip('"').endswith("-3")  # a multipart object's ETag counts its parts
        assert tier.get(KEYS[0]) == big
        assert (
            tier.read_range(KEYS[0], 6 * 1024**2, 6 * 1024**2 + 10)
            == big[6 * 1024**2 : 6 * 1024**2 + 10]
        )
    finally:
        tier.close()


def test_expiry_metadata_lifecycle_tag_and_extend(s3):
    tier = make_tier(s3, "expiry/")
    now = [1_900_000_000.0]
    tier.clock = lambda: now[0]
    try:
        tier.put(KEYS[0], b"a" * 100, expires_at=now[0] + 3 * 86400 - 5)
        tier.put(KEYS[1], b"b" * 100)
        client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
        tags = client.get_object_tagging(Bucket="kvfuse-test", Key="expiry/" + str(KEYS[0]))[
            "TagSet"
        ]
        assert tags == [{"Key": "kvfuse-retention-days", "Value": "3"}]
        assert (
            tier.expiry(KEYS[0]) == pytest.approx(now[0] + 3 * 86400 - 5)
            and tier.expiry(KEYS[1]) is None
        )
        assert tier.extend(KEYS[0], now[0] + 10 * 86400) and tier.expiry(KEYS[0]) == pytest.approx(
            now[0] + 10 * 86400
        )
        assert tier.extend(KEYS[0], now[0] + 86400)  # never shortens
        assert tier.expiry(KEYS[0]) == pytest.approx(now[0] + 10 * 86400)
        assert tier.get(KEYS[0]) == b"a" * 100  # the metadata rewrite kept the bytes
        now[0] += 11 * 86400
        assert (
            tier.get(KEYS[0]) is None
            and not tier.contains(KEYS[0])
            and tier.stats.snapshot()["expired"] == 1
        )
        assert tier.get(KEYS[1]) == b"b" * 100  # no expiry: kept
        tier.put(KEYS[2], b"c", expires_at=now[0] - 1)  # already past: not stored
        assert not tier.contains(KEYS[2])
    finally:
        tier.close()


def _head(s3, key: str) -> dict:
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
    return client.head_object(Bucket="kvfuse-test", Key=key)


def test_server_side_encryption_is_applied_to_every_put_upload_and_copy(s3):
    kms = boto3.client("kms", endpoint_url=s3.endpoint_url, region_name="us-east-1")
    key_id = kms.create_key(Description="kvfuse test")["KeyMetadata"]["Arn"]
    for sse, kms_key, prefix in (("AES256", None, "sse-s3/"), ("aws:kms", key_id, "sse-kms/")):
        tier = make_tier(s3, prefix, sse=sse, sse_kms_key_id=kms_key, multipart_bytes=5 * 1024**2)
        tier.clock = lambda: 1_900_000_000.0
        try:
            tier.put(KEYS[0], b"a" * 100, expires_at=1_900_000_000.0 + 86400)
            tier.put(KEYS[1], os.urandom(6 * 1024**2))  # a multipart upload
            assert tier.extend(KEYS[0], 1_900_000_000.0 + 9 * 86400)  # a server-side copy
            for k in KEYS[:2]:
                head = _head(s3, prefix + str(k))
                assert head["ServerSideEncryption"] == sse, (sse, k, head)
                assert head.get("SSEKMSKeyId") == kms_key
            assert tier.get(KEYS[0]) == b"a" * 100 and tier.stats.snapshot()["errors"] == 0
        finally:
            tier.close()
    plain = make_tier(s3, "sse-none/")
    try:
        plain.put(KEYS[0], b"x")
        # the bucket's default
        assert _head(s3, "sse-none/" + str(KEYS[0])).get("SSEKMSKeyId") is None
    finally:
        plain.close()


def test_sse_settings_from_the_configuration(s3):
    from kvfuse.config import ConfigError, load_config
    from kvfuse.runtime import open_store
    from kvfuse.tiers.s3 import sse_args

    env = {
        "KVFUSE_CACHE_DISK": "false",
        "KVFUSE_CACHE_S3_URL": "s3://kvfuse-test/sse-config/",
        "KVFUSE_CACHE_S3_ENDPOINT": s3.endpoint_url,
        "KVFUSE_CACHE_S3_REGION": "us-east-1",
        "KVFUSE_CACHE_S3_SSE": "aws:kms",
        "KVFUSE_CACHE_S3_SSE_KMS_KEY_ID": "alias/kvfuse",
    }
    # no keys in the configuration: boto3's chain (S3_ENV here)
    store = open_store(load_config(env=env))
    try:
        store.tier("s3").put(KEYS[3], b"v")
        head = _head(s3, "sse-config/" + str(KEYS[3]))
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == "alias/kvfuse"
    finally:
        store.close()
    for bad, words in (
        ({"KVFUSE_CACHE_S3_SSE": "aes256"}, "cache.s3_sse: must be AES256"),
        (
            {"KVFUSE_CACHE_S3_SSE": "AES256"},
            "cache.s3_sse_kms_key_id: a KMS key is used by aws:kms",
        ),
        ({"KVFUSE_CACHE_S3_URL": None}, "cache.s3_sse: is set but there is no S3 tier"),
    ):
        full = {k: v for k, v in {**env, **bad}.items() if v is not None}
        with pytest.raises(ConfigError, match=words):
            load_config(env=full)
    tiers = '[{kind: s3, url: "s3://b/p", sse: aws:kms, sse_kms_key_id: k1}]'
    assert load_config(env={"KVFUSE_CACHE_TIERS": tiers}).lower_tiers()[0].sse_kms_key_id == "k1"
    with pytest.raises(ConfigError, match=r"cache.tiers\[0\].sse: must be AES256"):
        load_config(env={"KVFUSE_CACHE_TIERS": '[{kind: s3, url: "s3://b", sse: kms}]'})
    assert sse_args(None) == {} and sse_args("AES256") == {"ServerSideEncryption": "AES256"}
    with pytest.raises(ValueError):
        sse_args("AES256", "k")


def test_an_outage_is_a_miss_and_the_tier_recovers(s3):
    tier = make_tier(s3, "outage/")
    try:
        tier.put(KEYS[0], b"x" * 500)
        s3.stop()
        t0 = time.monotonic()
        assert tier.get(KEYS[0]) is None and tier.get_many(KEYS[:3]) == [None] * 3
        tier.put(KEYS[1], b"y")  # dropped, not raised
        assert not tier.contains(KEYS[0]) and tier.delete_prefix("") == 0
        assert time.monotonic() - t0 < 10, "calls must be bounded while the store is away"
        s = tier.stats.snapshot()
        assert s["errors"] >= 1 and s["dropped_writes"] >= 1 and tier.is_backing_off()
        s3.start()  # same port; moto keeps nothing across restarts
        deadline = time.monotonic() + 10
        while tier.is_backing_off() and time.monotonic() < deadline:
            time.sleep(0.1)
        make_tier(s3, "outage/").close()  # the bucket again
        tier.put(KEYS[0], b"z" * 10)
        assert tier.get(KEYS[0]) == b"z" * 10
    finally:
        tier.close()


def test_an_engine_serves_chunks_from_s3(s3, tmp_path):
    from kvfuse_helpers import load_builtin, long_text

    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    model = load_builtin("smollm2")
    tier = make_tier(s3, "engine/")
    store = TieredStore(MemoryTier(1), [tier])  # memory keeps nothing: every hit comes from S3
    engine = Engine(model, store, EngineSettings.of(history=False))
    try:
        ids = model.tokenizer.encode(long_text(6))[:600]
        params = SamplingParams(max_tokens=4, temperature=0.0)
        first = engine.generate(ids, params)
        engine.flush()
        second = engine.generate(ids, params)
        assert second.cached_tokens == 512 and second.hit_tiers == ("s3", "s3")
        assert second.token_ids == first.token_ids
    finally:
        engine.close()
