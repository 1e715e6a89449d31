"""Secrets named by the configuration (a variable or a file) and URLs with their passwords redacted."""

from __future__ import annotations

import pytest
import redis

from kvfuse.config import ConfigError
from kvfuse.config.secrets import read_secret, redact_url
from kvfuse.tiers.redis.tier import failure_hint


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("rediss://alice:s3cr3t@h:6380/0", "rediss://alice:***@h:6380/0"),
        ("redis://:s3cr3t@h", "redis://:***@h"),
        ("rediss://u:p@ss:w@rd@h:1/0", "rediss://u:***@h:1/0"),  # '@' inside the password
        ("redis://h/0?password=s3cr3t&db=1", "redis://h/0?password=***&db=1"),
        ("unix:///run/redis.sock?db=0&password=s3cr3t", "unix:///run/redis.sock?db=0&password=***"),
        ("rediss://u:s3cr3t@[::1]:6380", "rediss://u:***@[::1]:6380"),
        ("redis://user@h", "redis://user@h"),  # a user without a password: nothing to hide
        ("rediss://u:s3cr3t@[::1", "rediss://***"),  # does not parse: hidden whole
        (None, None),
        ("", ""),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_read_secret_from_a_variable_or_a_file(tmp_path):
    assert read_secret("x", env_var="PW", env={"PW": "s3"}) == "s3"
    assert read_secret("x") is None
    for content, value in (("s3\n", "s3"), ("s3", "s3"), ("s3\r\n", "s3"), ("s 3\n\n", "s 3\n")):
        (tmp_path / "f").write_text(content)
        assert read_secret("x", path=str(tmp_path / "f")) == value
    with pytest.raises(
        ConfigError, match="cache.redis_password_env: the variable PW is not set; export PW"
    ):
        read_secret("cache.redis_password_env", env_var="PW", env={})
    with pytest.raises(ConfigError, match="the variable PW is empty"):
        read_secret("s", env_var="PW", env={"PW": ""})
    with pytest.raises(ConfigError, match="s: cannot read /nonexistent/pw"):
        read_secret("s", path="/nonexistent/pw")
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_secret("s", path=str(tmp_path / "bin"))


@pytest.mark.parametrize(
    "error, words",
    [
        (
            redis.exceptions.AuthenticationError(
                "invalid username-password pair or user is disabled."
            ),
            "ACL user",
        ),
        (
            redis.exceptions.NoPermissionError(
                "this user has no permissions to access one of the keys"
            ),
            "ACL user",
        ),
        (redis.exceptions.ResponseError("WRONGPASS invalid username-password pair"), "ACL user"),
        (
            redis.exceptions.ConnectionError(
                "Error 1 connecting to h:1. [SSL: CERTIFICATE_VERIFY_FAILED] ..."
            ),
            "redis_tls_ca_file",
        ),
        (
            redis.exceptions.ConnectionError(
                "Error 8 while writing to socket. EOF occurred in violation of protocol "
                "(_ssl.c:2427)."
            ),
            "redis_tls_cert_file",
        ),
        (
            redis.exceptions.ConnectionError("Error 111 connecting to h:1. Connection refused."),
            None,
        ),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), None),
    ],
)
def test_failure_hints(error, words):
    hint = failure_hint(error)
    assert (hint == "") == (words is None) and (words is None or words in hint), hint
