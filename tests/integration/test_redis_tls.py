"""The Redis tier over TLS with an ACL user, against a real redis-server that speaks only TLS
(``--port 0 --tls-port``), asks for client certificates and has the default user off: a CA, a
server and a client certificate are made at test time. The right CA, certificate and password
connect and entries round-trip; a wrong password, a missing CA or a missing client certificate is
a tier that is unavailable (misses, dropped writes, back-off), logged once with what to check and
never with the password."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from keyed import K

from kvfuse.codecs import get_codec
from kvfuse.config import ConfigError, load_config
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import decode_chunk, encode_entry
from kvfuse.runtime import open_store
from kvfuse.tiers import RedisTier
from kvfuse.tiers.redis.connection import Security

pytestmark = pytest.mark.integration

USER, PASSWORD = "kvfuse-app", "pw-Tq81-never-logged"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    pytest.importorskip("cryptography")
    from kvfuse_testkit.tls import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(tls_files):
    from kvfuse_testkit.tls import LocalTLSRedis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: apt-get install -y redis-server")
    server = LocalTLSRedis(tls_files, USER, PASSWORD)
    try:
        server.start()
    except RuntimeError as e:
        pytest.skip(f"this redis-server cannot serve TLS ({e}); Debian's can")
    yield server
    server.stop()


def security(tls, password=PASSWORD, ca=True, cert=True) -> Security:
    return Security(
        USER,
        password,
        str(tls.ca) if ca else None,
        str(tls.client_cert) if cert else None,
        str(tls.client_key) if cert else None,
    )


def tier(server, sec: Security) -> RedisTier:
    return RedisTier(server.url, timeout_s=1.0, backoff_s=0.3, security=sec)


def test_the_right_ca_certificate_and_password_connect(tls_redis, tls_files):
    t = tier(tls_redis, security(tls_files))
    try:
        assert t.ping()
        t.put(K("a"), b"value-a")
        assert t.get(K("a")) == b"value-a" and t.contains(K("a"))
        chunk = KVChunk(kv=torch.randn(2, 2, 16, 1, 8), positions=torch.arange(16))
        entry = encode_entry(chunk, K("e"), get_codec("raw"))
        t.put(K("e"), entry)
        assert torch.equal(decode_chunk(t.get(K("e")), K("e")).kv, chunk.kv)
        assert t.stats.snapshot()["errors"] == 0
    finally:
        t.close()


@pytest.mark.parametrize(
    "what, sec, hint",
    [
        ("a wrong password", dict(password="wrong"), "check the ACL user and its password"),
        ("no password", dict(password=None), "check the ACL user and its password"),
        ("no CA (the system's CAs do not know the test CA)", dict(ca=False), "redis_tls_ca_file"),
        ("no client certificate", dict(cert=False), "redis_tls_cert_file"),
    ],
)
def test_a_bad_credential_is_an_unavailable_tier_with_a_clear_log_line(
    tls_redis, tls_files, caplog, what, sec, hint
):
    t = tier(tls_redis, security(tls_files, **sec))
    try:
        with caplog.at_level(logging.WARNING, logger="kvfuse.tiers.backoff"):
            assert t.get(K("a")) is None  # a miss, never an exception
            t.put(K("b"), b"v")  # dropped, counted
        s = t.stats.snapshot()
        assert s["errors"] == 1 and s["dropped_writes"] == 1 and t.is_backing_off(), what
        assert not t.ping()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and hint in lines[0] and tls_redis.url in lines[0], lines
        assert PASSWORD not in lines[0] and "wrong" not in lines[0].split("failed (")[0]
    finally:
        t.close()


def test_the_configuration_reads_the_password_from_a_variable_or_a_file(
    tls_redis, tls_files, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("KVFUSE_TEST_REDIS_PASSWORD", PASSWORD)
    files = {
        "KVFUSE_CACHE_REDIS_TLS_CA_FILE": str(tls_files.ca),
        "KVFUSE_CACHE_REDIS_TLS_CERT_FILE": str(tls_files.client_cert),
        "KVFUSE_CACHE_REDIS_TLS_KEY_FILE": str(tls_files.client_key),
    }
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    for way in (
        {"KVFUSE_CACHE_REDIS_PASSWORD_ENV": "KVFUSE_TEST_REDIS_PASSWORD"},
        {"KVFUSE_CACHE_REDIS_PASSWORD_FILE": str(secret)},
    ):
        env = {
            "KVFUSE_CACHE_REDIS_URL": tls_redis.url,
            "KVFUSE_CACHE_REDIS_USERNAME": USER,
            "KVFUSE_CACHE_DISK": "false",
            "KVFUSE_TEST_REDIS_PASSWORD": PASSWORD,
            **files,
            **way,
        }
        config = load_config(env=env)
        assert PASSWORD not in repr(config)
        store = open_store(config)
        try:
            redis_tier = store.tier("redis")
            chunk = KVChunk(kv=torch.randn(2, 2, 16, 1, 8), positions=torch.arange(16))
            store.put([(K("via-config"), encode_entry(chunk, K("via-config"), get_codec("raw")))])
            assert store.flush(30)
            store.memory.clear()
            fetched = store.fetch([K("via-config")])[0]
            assert fetched.tier == "redis" and torch.equal(fetched.entry.decode(), chunk.kv)
            assert redis_tier.stats.snapshot()["errors"] == 0
        finally:
            store.close()
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize(
    "env, words",
    [
        (
            {"KVFUSE_CACHE_REDIS_PASSWORD_ENV": "KVFUSE_NOT_SET_ANYWHERE"},
            ["cache.redis_password_env:", "KVFUSE_NOT_SET_ANYWHERE is not set", "export"],
        ),
        (
            {"KVFUSE_CACHE_REDIS_PASSWORD_FILE": "/nonexistent/pw"},
            ["cache.redis_password_file:", "cannot read"],
        ),
        (
            {"KVFUSE_CACHE_REDIS_PASSWORD_ENV": "X", "KVFUSE_CACHE_REDIS_PASSWORD_FILE": "/x"},
            ["one way"],
        ),
        (
            {
                "KVFUSE_CACHE_REDIS_URL": "redis://127.0.0.1:6379/0",
                "KVFUSE_CACHE_REDIS_TLS_CA_FILE": "CA",
            },
            ["cache.redis_tls_ca_file:", "rediss://"],
        ),
        (
            {"KVFUSE_CACHE_REDIS_TLS_CERT_FILE": "CERT"},
            ["cache.redis_tls_cert_file:", "needs its key"],
        ),
        (
            {"KVFUSE_CACHE_REDIS_TLS_CA_FILE": "/nonexistent/ca.pem"},
            ["cache.redis_tls_ca_file:", "cannot read"],
        ),
        (
            {
                "KVFUSE_CACHE_REDIS_URL": "rediss://kv:s3cret-in-url@h:6380/0",
                "KVFUSE_CACHE_REDIS_PASSWORD_ENV": "X",
            },
            ["the URL holds a password already"],
        ),
        (
            {"KVFUSE_CACHE_REDIS_URL": None, "KVFUSE_CACHE_REDIS_USERNAME": "kv"},
            ["cache.redis_username:", "no Redis tier", "cache.redis_url"],
        ),
        ({"KVFUSE_CACHE_REDIS_URL": "http://kv:s3cret-in-url@h"}, ["cache.redis_url:", "kv:***@h"]),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(tls_files, env, words):
    full = {"KVFUSE_CACHE_REDIS_URL": "rediss://127.0.0.1:6380/0", "X": "x", **env}
    full = {
        k: v.replace("CA", str(tls_files.ca)).replace("CERT", str(tls_files.client_cert))
        if v
        else v
        for k, v in full.items()
        if v is not None
    }
    with pytest.raises(ConfigError) as e:
        load_config(env=full)
    message = str(e.value)
    for w in words:
        assert w in message, (w, message)
    assert "s3cret-in-url" not in message


def test_tier_sections_take_the_same_settings(tls_redis, tls_files, monkeypatch):
    monkeypatch.setenv("PW", PASSWORD)
    tiers = (
        f'[{{kind: redis, url: "{tls_redis.url}", username: {USER}, password_env: PW, '
        f'tls_ca_file: "{tls_files.ca}", tls_cert_file: "{tls_files.client_cert}", '
        f'tls_key_file: "{tls_files.client_key}"}}]'
    )
    store = open_store(load_config(env={"KVFUSE_CACHE_TIERS": tiers, "PW": PASSWORD}))
    try:
        assert store.tier("redis").ping()
    finally:
        store.close()
    with pytest.raises(
        ConfigError, match=r"cache.tiers\[0\].tls_ca_file: TLS settings need a rediss:// URL"
    ):
        load_config(
            env={
                "KVFUSE_CACHE_TIERS": f'[{{kind: redis, url: "redis://h:1", tls_ca_file: "{tls_files.ca}"}}]'
            }
        )
