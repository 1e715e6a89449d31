"""Checking a loaded configuration: ranges and consistency, with errors that say where each bad
value came from (``sources``: the file, the variable, the command line, or the default) and what
to write instead. Sections that check themselves (``BlendOptions``) were checked when made.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from kvfuse import dtypes
from kvfuse.codecs import codec_names, get_codec
from kvfuse.codecs.cachegen import LEVELS
from kvfuse.durations import parse_duration

from .api_keys import digest_bytes, entry_problem, is_digest, split_entry
from .encryption import cipher_of
from .secrets import redact_url
from .sections import (
    KERNEL_MODES,
    WEIGHT_FORMATS,
    CacheConfig,
    Config,
    ConfigError,
    EngineConfig,
    ServerConfig,
    TierConfig,
)
from .signing import signer_of
from .tenants import check_tenants

_REDIS_SECURITY_KEYS = (
    "redis_username",
    "redis_password_env",
    "redis_password_file",
    "redis_tls_ca_file",
    "redis_tls_cert_file",
    "redis_tls_key_file",
)
_FLAT_TIER_KEYS = (
    "disk",
    "disk_path",
    "disk_bytes",
    "disk_codec",
    "disk_codec_level",
    "redis_url",
    "redis_timeout_s",
    "redis_cluster",
    "redis_codec",
    "redis_codec_level",
    "s3_url",
    "s3_endpoint",
    "s3_region",
    "s3_timeout_s",
    "s3_codec",
    "s3_codec_level",
    "s3_sse",
    "s3_sse_kms_key_id",
    *_REDIS_SECURITY_KEYS,
)
SSE_MODES = (
    "AES256",
    "aws:kms",
)  # S3 server-side encryption (what the S3 API's ServerSideEncryption takes)
_URL_SCHEMES = {"redis": ("redis://", "rediss://", "unix://"), "s3": ("s3://",)}
# server.kv_events: a ZMQ endpoint kvfuse binds (tcp://HOST:PORT, HOST may be * or [v6]; ipc://PATH)
_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):([0-9]{1,5})|ipc://\S+")


def validate(c: Config, sources: Mapping[str, str]) -> None:
    """Range and consistency checks; ``sources`` says where each non-default value came from.
    One function per section checks it; the first value found wrong is the error raised."""

    def need(ok: bool, name: str, message: str):
        if not ok:
            # a tier's field: its list's source; a tenant's quota: the tenants mapping's source
            source = (
                sources.get(name)
                or sources.get(name.split("[")[0])
                or sources.get(name.split(".")[0])
            )
            where = f" (from {source})" if source else " (the default)"
            raise ConfigError(f"{name}: {message}{where}")

    _check_top_level(c, need)
    _check_engine(c.engine, need)
    _check_cache(c.cache, need)
    _check_flat_redis(c, need)
    _check_server(c.server, need)
    _check_abuse_limits(c, need)
    _check_kv_event_blocks(c, need)
    _check_codecs(c.cache, need)
    _check_flat_s3(c.cache, need)
    _check_tiers(c.cache, sources, need)
    _check_tenants(c, need)
    _check_streaming(c.cache, need)
    _check_retention(c, need)
    # the signing keys: one way, long enough, a key file that holds some
    signer_of(c.cache, sources)
    # the encryption keys: a key file of 32-byte hex keys
    cipher_of(c.cache, sources)


def _check_abuse_limits(c: Config, need: Callable) -> None:
    """The bounds on what one request, client or tenant may cost (issue 39): deadlines, the
    wedge report, authentication failures, connections, bodies, reported reuse, stored responses."""
    s = c.server
    need(s.request_timeout_s >= 0, "server.request_timeout_s", "must be >= 0 seconds (0: none)")
    need(s.stall_after_s > 0, "server.stall_after_s", "must be > 0 seconds")
    need(
        s.auth_failures_per_minute >= 0,
        "server.auth_failures_per_minute",
        "must be >= 0 (0: no limit)",
    )
    need(s.limit_concurrency >= 0, "server.limit_concurrency", "must be >= 0 (0: no limit)")
    need(s.body_timeout_s >= 0, "server.body_timeout_s", "must be >= 0 seconds (0: no limit)")
    for name in ("maintenance_workers", "maintenance_queue", "maintenance_per_tenant"):
        need(getattr(s, name) >= 1, f"server.{name}", "must be >= 1")
    need(s.maintenance_timeout_s > 0, "server.maintenance_timeout_s", "must be > 0 seconds")
    need(
        s.cached_tokens in ("chunk", "exact"),
        "server.cached_tokens",
        f"must be chunk or exact, got {s.cached_tokens!r}",
    )
    r = c.responses
    for key in ("max_response_bytes", "tenant_max_responses", "tenant_max_bytes"):
        value = getattr(r, key)
        need(value is None or value >= 1, f"responses.{key}", "must be >= 1, or none for no limit")


def _check_top_level(c: Config, need: Callable) -> None:
    """The top-level fields: the model, where and how it runs, the threads, the log level and the
    context window."""
    need(
        c.device in ("auto", "cpu", "cuda") or c.device.startswith("cuda:"),
        "device",
        f"must be auto, cpu or cuda[:N], got {c.device!r}",
    )
    need(
        c.dtype == "auto" or c.dtype in dtypes.COMPUTE_DTYPES,
        "dtype",
        f"must be auto, {', '.join(dtypes.COMPUTE_DTYPES)}, got {c.dtype!r}",
    )
    need(
        c.weights in WEIGHT_FORMATS,
        "weights",
        f"must be one of {', '.join(WEIGHT_FORMATS)} (auto = as the model file holds them, "
        "fp32 = dequantized to the compute dtype, int8 = int8 projections on CPU), "
        f"got {c.weights!r}",
    )
    need(
        c.weights != "int8" or not c.device.startswith("cuda"),
        "weights",
        f"int8 runs on the CPU only (PyTorch's fbgemm kernels), not on device {c.device!r}; use weights: auto "
        "with a GPU, or device: cpu",
    )
    need(
        c.kernels in KERNEL_MODES,
        "kernels",
        "must be one of auto (kvfuse's CPU kernels where they build), on (required) or off "
        f"(PyTorch's operators only), got {c.kernels!r}",
    )
    need(
        c.kernels != "on" or not c.device.startswith("cuda"),
        "kernels",
        f"on runs kvfuse's CPU kernels, which do not run on device {c.device!r}; use kernels: auto",
    )
    need(c.threads >= 0, "threads", "must be >= 0 (0 = all cores)")
    need(
        c.log_level.lower() in ("debug", "info", "warning", "error"),
        "log_level",
        "must be debug, info, warning or error",
    )
    need(bool(c.model), "model", "must name a built-in model, a model folder or a .gguf file")
    need(
        c.context_tokens == 0 or c.context_tokens >= 16,
        "context_tokens",
        f"must be 0 (the model's context window) or at least 16 tokens, got {c.context_tokens}",
    )


def _check_engine(e: EngineConfig, need: Callable) -> None:
    """``engine``: the continuous batching limits (sequences and tokens per step, live KV)."""
    need(
        e.max_running >= 1,
        "engine.max_running",
        f"must be >= 1 sequences per step, got {e.max_running}",
    )
    need(
        e.max_step_tokens >= 1,
        "engine.max_step_tokens",
        f"must be >= 1 token per step, got {e.max_step_tokens}",
    )
    need(
        e.max_prefill_tokens is None or e.max_prefill_tokens >= 1,
        "engine.max_prefill_tokens",
        f"must be >= 1 token per step (or null: max_step_tokens), got {e.max_prefill_tokens}",
    )
    need(
        e.kv_memory_bytes is None or e.kv_memory_bytes > 0,
        "engine.kv_memory_bytes",
        "must be a size > 0 (e.g. 1GiB), or none for no limit",
    )
    need(
        e.release_idle_s is None or e.release_idle_s >= 0,
        "engine.release_idle_s",
        f"must be >= 0 seconds (or null: never give the heap back), got {e.release_idle_s}",
    )


def _check_cache(k: CacheConfig, need: Callable) -> None:
    """``cache``'s own settings (not its tiers'): chunking, KV dtype, the write queue, the history
    records, truncation and eviction."""
    need(
        16 <= k.chunk_size <= 65536,
        "cache.chunk_size",
        f"must be between 16 and 65536 tokens, got {k.chunk_size} (256 is the default)",
    )
    need(
        k.kv_dtype in dtypes.KV_DTYPES,
        "cache.kv_dtype",
        f"must be one of {', '.join(dtypes.KV_DTYPES)}, got {k.kv_dtype!r}",
    )
    need(k.codec_level >= 0, "cache.codec_level", "must be >= 0")
    need(k.write_queue >= 1, "cache.write_queue", "must be >= 1")
    need(k.save_queue >= 1, "cache.save_queue", "must be >= 1")
    need(k.redis_timeout_s > 0, "cache.redis_timeout_s", "must be > 0 seconds")
    need(
        k.history_records >= 0,
        "cache.history_records",
        "must be >= 0 (0: remember no histories' ids)",
    )
    need(
        k.truncation in ("reuse", "recompute", "off"),
        "cache.truncation",
        f"must be reuse, recompute or off, got {k.truncation!r}",
    )
    need(
        k.eviction in ("queue", "lru"),
        "cache.eviction",
        f"must be queue or lru, got {k.eviction!r}",
    )


def _check_flat_redis(c: Config, need: Callable) -> None:
    """The flat ``cache.redis_url`` and, without ``cache.tiers``, its ACL and TLS keys."""
    k = c.cache
    need(
        k.redis_url is None or k.redis_url.startswith(("redis://", "rediss://", "unix://")),
        "cache.redis_url",
        f"must start with redis://, rediss:// or unix://, got {redact_url(k.redis_url)!r}",
    )
    if k.tiers is None:
        _check_flat_redis_security(c, need)


def _check_server(s: ServerConfig, need: Callable) -> None:
    """``server``: the port, the queue and body limits, the token limits, the API keys and the
    ``/metrics`` token."""
    need(1 <= s.port <= 65535, "server.port", f"must be in 1..65535, got {s.port}")
    need(s.max_queue >= 1, "server.max_queue", "must be >= 1")
    need(s.max_body_bytes >= 1024, "server.max_body_bytes", "must be at least 1KiB")
    need(s.max_chat_messages >= 1, "server.max_chat_messages", "must be >= 1")
    need(s.max_chat_chars >= 1, "server.max_chat_chars", "must be >= 1 character")
    need(s.grammar_cache_size >= 0, "server.grammar_cache_size", "must be >= 0 (0: no cache)")
    need(
        1 <= s.default_max_tokens <= s.max_tokens_limit,
        "server.default_max_tokens",
        "must be between 1 and server.max_tokens_limit",
    )
    for entry in s.api_keys:
        problem = entry_problem(entry)
        need(problem is None, "server.api_keys", problem or "")
    _check_metrics_token(s, need)
    need(bool(s.owned_by.strip()), "server.owned_by", "must not be empty (the default is vllm)")
    _check_kv_events(s, need)


def _check_kv_events(s: ServerConfig, need: Callable) -> None:
    """``server.kv_events*``: the endpoints' form and the positive bounds (the block size against
    ``cache.chunk_size`` is checked in ``_check_kv_event_blocks``, which sees both sections)."""
    for name in ("kv_events", "kv_events_replay"):
        value = getattr(s, name)
        need(
            value is None or _ENDPOINT.fullmatch(value) is not None,
            f"server.{name}",
            f"must be a ZMQ endpoint tcp://HOST:PORT (HOST may be *) or ipc://PATH, got {value!r}",
        )
    need(
        s.kv_events_replay is None or s.kv_events is not None,
        "server.kv_events_replay",
        "needs server.kv_events (the live stream it replays)",
    )
    need(
        s.kv_events_replay is None or s.kv_events_replay != s.kv_events,
        "server.kv_events_replay",
        "must differ from server.kv_events",
    )
    for name in ("kv_events_block_size", "kv_events_queue", "kv_events_buffer", "kv_events_chunks"):
        need(getattr(s, name) >= 1, f"server.{name}", f"must be >= 1, got {getattr(s, name)}")


def _check_kv_event_blocks(c: Config, need: Callable) -> None:
    """An announced block must tile the chunks: ``server.kv_events_block_size`` divides
    ``cache.chunk_size`` (each chunk is announced as whole blocks), and the port is a port."""
    s = c.server
    if s.kv_events is None:
        return
    bs, ch = s.kv_events_block_size, c.cache.chunk_size
    need(
        ch % bs == 0,
        "server.kv_events_block_size",
        f"must divide cache.chunk_size ({ch}), got {bs}; the router's --kv-event-block-size must "
        "be the same number (16, vLLM's default block size, divides the default chunk of 256)",
    )
    for name in ("kv_events", "kv_events_replay"):
        m = _ENDPOINT.fullmatch(getattr(s, name) or "")
        if m is not None and m.group(2) is not None:
            need(1 <= int(m.group(2)) <= 65535, f"server.{name}", "the port must be in 1..65535")


def _check_codecs(k: CacheConfig, need: Callable) -> None:
    """The write codecs, each a known one at a level it has: ``cache.codec`` and the flat tiers'
    own (``cache.disk_codec``, ...)."""
    for tier in ("", "disk_", "redis_", "s3_"):
        _check_codec(
            need, f"cache.{tier}codec", getattr(k, f"{tier}codec"), getattr(k, f"{tier}codec_level")
        )


def _check_flat_s3(k: CacheConfig, need: Callable) -> None:
    """The flat ``cache.s3_*`` keys: the bucket URL, the time-out and, without ``cache.tiers``,
    the server-side encryption (only with an S3 tier)."""
    need(
        k.s3_url is None or (k.s3_url.startswith("s3://") and len(k.s3_url) > 5),
        "cache.s3_url",
        f"must look like s3://BUCKET or s3://BUCKET/PREFIX, got {k.s3_url!r}",
    )
    need(k.s3_timeout_s > 0, "cache.s3_timeout_s", "must be > 0 seconds")
    if k.tiers is None:
        need(
            k.s3_url is not None or (k.s3_sse is None and k.s3_sse_kms_key_id is None),
            "cache.s3_sse",
            "is set but there is no S3 tier; set cache.s3_url (s3://BUCKET/PREFIX) or remove it",
        )
        _check_sse(k.s3_sse, k.s3_sse_kms_key_id, lambda f: f"cache.s3_{f}", need)


def _check_streaming(k: CacheConfig, need: Callable) -> None:
    """CacheGen streaming (the levels a load may pick, the load budget) and the coding workers."""
    need(
        all(level in LEVELS for level in k.stream_levels),
        "cache.stream_levels",
        f"must be CacheGen levels ({', '.join(map(str, LEVELS))}), got {list(k.stream_levels)}",
    )
    need(
        k.kv_slo_ms is None or k.kv_slo_ms > 0,
        "cache.kv_slo_ms",
        f"must be > 0 milliseconds, got {k.kv_slo_ms}",
    )
    need(
        k.codec_workers is None or k.codec_workers >= 0,
        "cache.codec_workers",
        "must be >= 0 (0: code in the calling process)",
    )


def _check_retention(c: Config, need: Callable) -> None:
    """How long things are kept: ``cache.retention`` (the forms ``reuse.retention.Retention.parse``
    reads) and ``responses.ttl``."""
    k = c.cache
    if k.retention is not None and k.retention != "in_memory":
        try:
            parse_duration(k.retention)
        except ValueError as e:
            need(False, "cache.retention", f"{e}; or 'in_memory' (or none: the tiers' policy)")
    try:
        parse_duration(c.responses.ttl)
    except ValueError as e:
        need(False, "responses.ttl", str(e))


def _check_metrics_token(s: ServerConfig, need: Callable) -> None:
    """``server.metrics_token`` (a token or its digest) or ``metrics_token_file``: one of them, well formed."""
    need(
        not (s.metrics_token and s.metrics_token_file),
        "server.metrics_token",
        "give the /metrics token one way: server.metrics_token (or KVFUSE_SERVER_METRICS_TOKEN) or "
        "server.metrics_token_file, not both",
    )
    if s.metrics_token is not None:
        need(
            s.metrics_token != "",
            "server.metrics_token",
            "is empty; set a token, or remove the setting to leave /metrics open",
        )
        if is_digest(s.metrics_token):
            try:
                digest_bytes(s.metrics_token)
            except ValueError as e:
                need(False, "server.metrics_token", str(e))


def _check_tenants(c: Config, need: Callable) -> None:
    """``tenants``: see ``tenants.check_tenants``."""
    if not c.tenants:
        return
    tiers = c.lower_tiers()
    kinds = {"memory": "memory", **{t.tier_name: t.kind for t in tiers}}
    capacities = {
        "memory": c.cache.memory_bytes if c.cache.enabled else None,
        **{t.tier_name: t.capacity if t.kind == "disk" else None for t in tiers},
    }
    key_tenants = {tenant for _, tenant in map(split_entry, c.server.api_keys)}
    check_tenants(c.tenants, key_tenants, kinds, capacities, need)


def _check_flat_redis_security(c: Config, need: Callable) -> None:
    """The flat ``cache.redis_*`` ACL and TLS keys: only with ``cache.redis_url``, then as a tier's."""
    k = c.cache
    given = [key for key in _REDIS_SECURITY_KEYS if getattr(k, key) is not None]
    if not k.redis_url:
        need(
            not given,
            f"cache.{given[0]}" if given else "cache.redis_url",
            "is set but there is no Redis tier; set cache.redis_url (e.g. rediss://host:6380/0) or remove it",
        )
        return
    tier = next(t for t in c.lower_tiers() if t.kind == "redis")
    _check_redis_security(tier, lambda field: f"cache.redis_{field}", need)


def _check_redis_security(t: TierConfig, name: Callable[[str], str], need: Callable) -> None:
    """A Redis tier's ACL user and TLS files: the password in one place, TLS only over rediss://,
    a client certificate with its key, files that can be read. ``name(field)``: the setting's name."""
    need(
        not (t.password_env and t.password_file),
        name("password_env"),
        f"give the password one way: {name('password_env')} or {name('password_file')}, not both",
    )
    try:
        in_url = urlsplit(t.url or "").password is not None or "password=" in (t.url or "")
    except ValueError:
        in_url = False
    need(
        not (in_url and (t.password_env or t.password_file)),
        name("password_env" if t.password_env else "password_file"),
        "the URL holds a password already; remove it from the URL (a URL is easily logged) and keep the setting",
    )
    tls = [f for f in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(t, f)]
    if tls:
        need(
            (t.url or "").startswith("rediss://"),
            name(tls[0]),
            f"TLS settings need a rediss:// URL, got {redact_url(t.url)!r}; write rediss://HOST:PORT/DB",
        )
    need(
        bool(t.tls_cert_file) == bool(t.tls_key_file),
        name("tls_cert_file" if t.tls_cert_file else "tls_key_file"),
        f"a client certificate needs its key: give both {name('tls_cert_file')} and {name('tls_key_file')}",
    )
    for f in tls:
        path = getattr(t, f)
        need(
            os.access(os.path.expanduser(path), os.R_OK)
            and os.path.isfile(os.path.expanduser(path)),
            name(f),
            f"cannot read {path}; check the path and that this user may read it",
        )


def _check_sse(
    sse: str | None, kms_key_id: str | None, name: Callable[[str], str], need: Callable
) -> None:
    """An S3 tier's server-side encryption: AES256 or aws:kms, a KMS key only with aws:kms."""
    need(
        sse in (None, *SSE_MODES),
        name("sse"),
        f"must be AES256 (S3-managed keys) or aws:kms (a KMS key), got {sse!r}; or none: the bucket's default",
    )
    need(
        kms_key_id is None or sse == "aws:kms",
        name("sse_kms_key_id"),
        f"a KMS key is used by aws:kms encryption only: set {name('sse')}: aws:kms, or remove the key",
    )


def _check_codec(need: Callable, name: str, codec: str | None, level: int) -> None:
    """A tier's write codec: a known one, at a level it has."""
    if codec is None:
        return
    need(
        codec in codec_names(),
        name,
        f"unknown codec {codec!r}; known codecs: {', '.join(codec_names())}",
    )
    try:
        get_codec(codec, level)
    except ValueError as e:
        need(False, f"{name}_level", str(e))


def _check_tiers(k: CacheConfig, sources: Mapping[str, str], need: Callable) -> None:
    """``cache.tiers``: not mixed with the flat tier keys, unique names, and per tier its URL, its
    time-out and its codec."""
    if k.tiers is None:
        return
    flat = [f"cache.{key}" for key in _FLAT_TIER_KEYS if f"cache.{key}" in sources]
    need(
        not flat,
        "cache.tiers",
        f"give the tiers either as cache.tiers or as flat keys, not both; remove "
        f"{', '.join(flat)} (set by {', '.join(sorted({sources[f] for f in flat}))})",
    )
    names = [t.tier_name for t in k.tiers]
    need(
        len(set(names)) == len(names) and "memory" not in names,
        "cache.tiers",
        f"tier names must be unique and not 'memory', got {names}; give each tier a name: ...",
    )
    for i, t in enumerate(k.tiers):
        where = f"cache.tiers[{i}]"
        if t.kind in _URL_SCHEMES:
            need(
                bool(t.url) and t.url.startswith(_URL_SCHEMES[t.kind]) and len(t.url) > 5,
                f"{where}.url",
                f"a {t.kind} tier needs a url starting with {' or '.join(_URL_SCHEMES[t.kind])}, "
                f"got {redact_url(t.url)!r}",
            )
        if t.kind == "redis":
            _check_redis_security(t, lambda field, i=i: f"cache.tiers[{i}].{field}", need)
        if t.kind == "s3":
            _check_sse(
                t.sse, t.sse_kms_key_id, lambda field, i=i: f"cache.tiers[{i}].{field}", need
            )
        need(t.timeout_s is None or t.timeout_s > 0, f"{where}.timeout_s", "must be > 0 seconds")
        _check_codec(need, f"{where}.codec", t.codec, t.codec_level)
