"""The ``tenants:`` section: quotas read from a file or KVFUSE_TENANTS, and errors naming the fix."""

from __future__ import annotations

import pytest
import yaml

from kvfuse.config import ConfigError, load_config
from kvfuse.config.tenants import TenantQuota, quota_of, tier_quotas
from kvfuse.kv.keys import tenant_tag
from kvfuse.runtime import open_store

KEYS = {"KVFUSE_SERVER_API_KEYS": "ka:alice,kb:bob"}


def test_tenants_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "server": {"api_keys": ["ka:alice", "kb:bob"]},
                "tenants": {
                    "alice": {
                        "quota": {
                            "memory_bytes": "64MiB",
                            "disk_bytes": "1GiB",
                            "requests_per_minute": 60,
                        }
                    },
                    "*": {"quota": {"memory_bytes": "16MiB"}},
                },
            }
        )
    )
    c = load_config(path)
    assert set(c.tenants) == {
        TenantQuota("alice", (("disk", 1 << 30), ("memory", 64 << 20)), 60),
        TenantQuota("*", (("memory", 16 << 20),), None),
    }  # safe_dump sorted the keys
    assert quota_of(c.tenants, "alice").requests_per_minute == 60
    assert quota_of(c.tenants, "bob").tenant == "*"
    assert tier_quotas(c.tenants, "memory") == ({"alice": 64 << 20}, 16 << 20)
    assert tier_quotas(c.tenants, "disk") == ({"alice": 1 << 30}, None)
    env = load_config(env={**KEYS, "KVFUSE_TENANTS": "{bob: {quota: {requests_per_minute: 5}}}"})
    assert env.tenants == (TenantQuota("bob", (), 5),)
    assert load_config(env={"KVFUSE_TENANTS": ""}).tenants == ()


def test_the_store_gets_each_tiers_quotas_by_tenant_tag(tmp_path):
    c = load_config(
        env={
            **KEYS,
            "KVFUSE_CACHE_DISK_PATH": str(tmp_path),
            "KVFUSE_TENANTS": "{alice: {quota: {memory_bytes: 1MiB, disk_bytes: 2MiB}}}",
        }
    )
    store = open_store(c)
    try:
        for tier, limit in (("memory", 1 << 20), ("disk", 2 << 20)):
            quotas = store.tier(tier)._quotas
            assert (
                quotas.limit_of_tag(tenant_tag("alice")) == limit
                and quotas.limit_of_tag(tenant_tag("bob")) is None
            )
    finally:
        store.close()


@pytest.mark.parametrize(
    "tenants, extra, words",
    [
        (
            "{carol: {quota: {memory_bytes: 1MiB}}}",
            {},
            ["tenants.carol:", "no API key names this tenant", "alice, bob", "KEY:carol", '"*"'],
        ),
        (
            "{alice: {quota: {redis_bytes: 1MiB}}}",
            {"KVFUSE_CACHE_REDIS_URL": "redis://h:6379"},
            [
                "tenants.alice.quota.redis_bytes:",
                "does not account bytes per tenant",
                "maxmemory",
                "memory, disk",
            ],
        ),
        ("{alice: {quota: {nvme_bytes: 1MiB}}}", {}, ["no tier is named 'nvme'", "memory, disk"]),
        (
            "{alice: {quota: {memory_bytes: 3GiB}}}",
            {},
            ["tenants.alice.quota.memory_bytes:", "more than the whole memory"],
        ),
        ("{alice: {quota: {memory_bytes: 0}}}", {}, ["must be a size > 0"]),
        (
            "{alice: {quota: {memory_bytes: lots}}}",
            {},
            ["tenants.alice.quota.memory_bytes:", "512MiB"],
        ),
        (
            "{alice: {quota: {requests_per_minute: 0}}}",
            {},
            ["requests_per_minute: expected a whole number >= 1"],
        ),
        ("{alice: {quota: {rpm: 5}}}", {}, ["'rpm' is not a quota", "requests_per_minute"]),
        ("{alice: {limits: {}}}", {}, ["tenants.alice: expected a section with a quota"]),
        ("[alice]", {}, ["tenants: expected a mapping", "for example"]),
        ("{alice: [", {}, ["tenants: not a YAML mapping"]),
    ],
)
def test_bad_tenants_name_the_key_the_source_and_the_fix(tenants, extra, words):
    with pytest.raises(ConfigError) as e:
        load_config(env={**KEYS, **extra, "KVFUSE_TENANTS": tenants})
    message = str(e.value)
    assert "KVFUSE_TENANTS" in message, message
    for w in words:
        assert w in message, (w, message)
