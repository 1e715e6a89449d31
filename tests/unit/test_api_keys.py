"""API keys as SHA-256 digests, the constant-time check, the /metrics token and ``kvfuse keys digest``."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys

import pytest

from kvfuse.cli import main
from kvfuse.config import ConfigError, load_config
from kvfuse.config.api_keys import digest_bytes, entry_problem, is_digest, key_digest, split_entry
from kvfuse.server.auth import Authenticator, MetricsToken
from kvfuse.server.errors import APIError

ALICE = "sk-alice-123"
ALICE_DIGEST = "sha256:" + hashlib.sha256(ALICE.encode()).hexdigest()


@pytest.mark.parametrize(
    "entry, expected",
    [
        ("sk-a:alice", ("sk-a", "alice")),
        ("sk-a:team:a", ("sk-a", "team:a")),  # a tenant may hold colons
        (f"{ALICE_DIGEST}:alice", (ALICE_DIGEST, "alice")),
        (f"{ALICE_DIGEST}:team:a", (ALICE_DIGEST, "team:a")),
        ("just-a-key", ("just-a-key", "")),
        ("sha256:abc", ("sha256:abc", "")),
    ],
)
def test_split_entry(entry, expected):
    assert split_entry(entry) == expected


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("sk-a:alice", None),
        (f"{ALICE_DIGEST}:alice", None),
        ("just-a-key", "KEY:TENANT or sha256:<64 hex digits>:TENANT"),
        (":alice", "KEY:TENANT"),
        (f"{ALICE_DIGEST}", "KEY:TENANT"),  # a digest without a tenant
        ("sha256:abc:alice", "kvfuse keys digest"),  # too short
        (
            ALICE_DIGEST.upper().replace("SHA256", "sha256") + ":alice",
            "64 hex digits",
        ),  # uppercase hex
    ],
)
def test_entry_problem_names_the_form_and_the_fix(entry, problem):
    got = entry_problem(entry)
    assert (got is None) == (problem is None), got
    if problem:
        assert problem in got


def test_an_error_never_repeats_a_plain_key_in_full():
    assert "a-very-secret-key" not in entry_problem("a-very-secret-key")


def test_digests():
    assert key_digest(ALICE) == ALICE_DIGEST
    assert (
        digest_bytes(ALICE) == digest_bytes(ALICE_DIGEST) == hashlib.sha256(ALICE.encode()).digest()
    )
    assert is_digest(ALICE_DIGEST) and not is_digest(ALICE)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        digest_bytes("sha256:xyz")


def test_authenticator_takes_plain_keys_and_digests_alike():
    auth = Authenticator({ALICE_DIGEST: "alice", "sk-bob": "bob"})
    assert auth.enabled and auth.tenants == {"alice", "bob"}
    assert auth.tenant(ALICE) == "alice" and auth.tenant("sk-bob") == "bob"
    for wrong in ("sk-alice-12", ALICE_DIGEST, ALICE + " ", "sk-BOB", "\u00e9"):
        with pytest.raises(APIError) as e:
            auth.tenant(wrong)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(APIError, match="missing API key"):
        auth.tenant(None)
    assert Authenticator({}).tenant("anything") == ""


def test_the_check_compares_every_digest_in_constant_time(monkeypatch):
    """hmac.compare_digest over digests of equal length, every configured one, match or not."""
    import kvfuse.server.auth as auth_module

    calls = []
    real = auth_module.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    auth = Authenticator({f"sk-{i}": f"t{i}" for i in range(5)})
    assert auth.tenant("sk-0") == "t0"  # the first one matches: the other four are compared anyway
    assert calls == [(32, 32)] * 5
    calls.clear()
    with pytest.raises(APIError):
        auth.tenant("x" * 1000)  # a long guess is hashed first: still 32-byte comparisons
    assert calls == [(32, 32)] * 5


def test_metrics_token():
    MetricsToken(None).check(None)  # open
    for token in ("s3cret", key_digest("s3cret")):
        check = MetricsToken(token)
        check.check("s3cret")
        for wrong in (None, "", "s3cre", key_digest("s3cret")):
            with pytest.raises(APIError) as e:
                check.check(wrong)
            assert e.value.status == 401 and "server.metrics_token" in e.value.message
            assert e.value.headers == {"www-authenticate": "Bearer"}


def test_config_accepts_digest_entries_and_names_bad_ones(tmp_path):
    c = load_config(env={"KVFUSE_SERVER_API_KEYS": f"{ALICE_DIGEST}:alice,sk-bob:bob"})
    assert c.api_key_map() == {ALICE_DIGEST: "alice", "sk-bob": "bob"}
    # secrets stay out of a config's repr
    assert ALICE_DIGEST not in repr(c) and "sk-bob" not in repr(c)
    with pytest.raises(
        ConfigError, match=r"server.api_keys: a digest entry .*kvfuse keys digest.*KVFUSE_SERVER"
    ):
        load_config(env={"KVFUSE_SERVER_API_KEYS": "sha256:1234:alice"})


def test_metrics_token_settings(tmp_path):
    assert load_config(env={"KVFUSE_SERVER_METRICS_TOKEN": "tok"}).server.metrics_token == "tok"
    with pytest.raises(ConfigError, match="server.metrics_token: .*64 lowercase hex"):
        load_config(env={"KVFUSE_SERVER_METRICS_TOKEN": "sha256:beef"})
    with pytest.raises(ConfigError, match="one way"):
        load_config(
            env={"KVFUSE_SERVER_METRICS_TOKEN": "tok", "KVFUSE_SERVER_METRICS_TOKEN_FILE": "/x"}
        )
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"server.metrics_token_file: cannot read {missing}"):
        load_config(env={"KVFUSE_SERVER_METRICS_TOKEN_FILE": str(missing)})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(env={"KVFUSE_SERVER_METRICS_TOKEN_FILE": str(empty)})
    good = tmp_path / "token"
    good.write_text("tok\n")
    assert load_config(
        env={"KVFUSE_SERVER_METRICS_TOKEN_FILE": str(good)}
    ).server.metrics_token_file == str(good)


def test_keys_digest_command(capsys, monkeypatch):
    assert main(["keys", "digest", ALICE]) == 0
    assert capsys.readouterr().out == ALICE_DIGEST + "\n"
    assert main(["keys", "digest", ALICE, "--tenant", "alice"]) == 0
    entry = capsys.readouterr().out.strip()
    assert entry == f"{ALICE_DIGEST}:alice" and entry_problem(entry) is None
    monkeypatch.setattr(sys, "stdin", io.StringIO(ALICE + "\n"))
    assert main(["keys", "digest"]) == 0
    assert capsys.readouterr().out == ALICE_DIGEST + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["keys", "digest"]) == 2
    assert "no key given" in capsys.readouterr().err
    assert main(["keys", "digest", ALICE_DIGEST]) == 2
    assert "a digest already" in capsys.readouterr().err


def test_keys_digest_as_a_process_reading_stdin():
    out = subprocess.run(
        [sys.executable, "-m", "kvfuse.cli", "keys", "digest", "--tenant", "alice"],
        input=ALICE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{ALICE_DIGEST}:alice\n" and ALICE not in out.stdout + out.stderr
