"""Secrets named by the configuration: a password or token read from a variable or a file.

The configuration holds where a secret is (``cache.redis_password_env: REDIS_PASSWORD``,
``cache.redis_password_file: /run/secrets/redis``, ``server.metrics_token_file``), never the
secret itself, so a dump of it (or a log line, or a traceback) reveals nothing. The loader checks
that each named secret can be read (``check_secrets``, a ConfigError naming the setting and the
fix); the parts that use one read it when they open (``read_secret``, from this process's
environment). A password written in a URL anyway is never shown: ``redact_url``.

A secret file holds the secret alone; one trailing newline (as ``echo`` or an editor leaves it)
is not part of it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from .sections import ConfigError

REDACTED = "***"
_QUERY_SECRET = re.compile(r"([?&](?:password|pass|secret|token)=)[^&#]*", re.IGNORECASE)


def redact_url(url: str | None) -> str | None:
    """``url`` with any password replaced by ``***`` (``rediss://user:***@host:6380/0``; a
    ``?password=`` query argument too), for log lines, error messages and listings. A URL that does
    not parse is redacted after its scheme (``rediss://***``) rather than shown."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        scheme, sep, _ = url.partition("://")
        return f"{scheme}://{REDACTED}" if sep else REDACTED
    if password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        url = parts._replace(netloc=f"{user}:{REDACTED}@{host}").geturl()
    return _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, url)


def read_secret(
    setting: str,
    *,
    env_var: str | None = None,
    path: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """The secret in variable ``env_var`` (of ``env``, default this process's environment) or in
    the file ``path``; None when neither is given. ConfigError, naming ``setting`` and the fix,
    when the variable is unset or empty or the file cannot be read or is empty."""
    if env_var:
        env = os.environ if env is None else env
        value = env.get(env_var)
        if not value:
            raise ConfigError(
                f"{setting}: the variable {env_var} is {'empty' if value == '' else 'not set'}; "
                f"export {env_var}=... in the server's environment, or use a file instead"
            )
        return value
    if path:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"{setting}: cannot read {path}: {e.strerror or e}; check the path and that this "
                "user may read it"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"{setting}: {path} is not UTF-8 text; write the secret alone in the file"
            ) from None
        value = text[:-1] if text.endswith("\n") else text
        value = value[:-1] if value.endswith("\r") else value
        if not value:
            raise ConfigError(f"{setting}: {path} is empty; write the secret alone in the file")
        return value
    return None


def check_secrets(config, env: Mapping[str, str]) -> None:
    """Every secret ``config`` names can be read (from ``env`` for variables); a ConfigError naming
    the setting and the fix otherwise. Called once by the loader, after ``validate``."""
    from .api_keys import digest_bytes

    for i, tier in enumerate(config.lower_tiers()):
        if tier.kind == "redis" and (tier.password_env or tier.password_file):
            where = (
                "cache.redis_password"
                if config.cache.tiers is None
                else f"cache.tiers[{i}].password"
            )
            suffix = "_env" if tier.password_env else "_file"
            read_secret(where + suffix, env_var=tier.password_env, path=tier.password_file, env=env)
    token = read_secret("server.metrics_token_file", path=config.server.metrics_token_file, env=env)
    if token is not None:
        try:
            digest_bytes(token)
        except ValueError as e:
            raise ConfigError(
                f"server.metrics_token_file: {config.server.metrics_token_file}: {e}"
            ) from None
