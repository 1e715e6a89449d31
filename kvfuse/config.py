"""One frozen, validated configuration: defaults < YAML file < ``KVFUSE_*`` environment < CLI flags.

The file mirrors the dataclasses::

    model: smollm2
    cache:
      chunk_size: 256
      memory_bytes: 2GiB
      redis_url: redis://127.0.0.1:6379/0
    blend:
      recompute_ratio: 0.15
    engine:
      max_running: 16
      kv_memory_bytes: 1GiB
    responses:
      ttl: 7d
    server:
      port: 8000
      api_keys: ["sk-alice:alice", "sk-bob:bob"]

Environment variables: ``KVFUSE_<FIELD>`` for top-level fields (``KVFUSE_MODEL``, ``KVFUSE_HOME``),
``KVFUSE_CACHE_<FIELD>``, ``KVFUSE_BLEND_<FIELD>``, ``KVFUSE_ENGINE_<FIELD>``, ``KVFUSE_RESPONSES_<FIELD>``
and ``KVFUSE_SERVER_<FIELD>`` for the sections
(``KVFUSE_CACHE_REDIS_URL``),
``KVFUSE_CONFIG`` for the file. Only this module reads the environment, and only when asked to.
Every error names the field, where the bad value came from, and what to write instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, its source and the fix."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
          "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}
KV_DTYPES = ("float16", "bfloat16", "float32")
WEIGHT_FORMATS = ("auto", "int8")  # = models.quant.WEIGHT_FORMATS (a unit test keeps them equal)


@dataclass(frozen=True)
class CacheConfig:
    """The KV store: chunking, encoding, and the tiers (memory, disk, Redis)."""

    enabled: bool = True
    chunk_size: int = 256
    kv_dtype: str = "float16"
    codec: str = "raw"
    codec_level: int = 0
    memory_bytes: int = 2 * 1024**3
    disk: bool = True
    disk_path: str | None = None  # default: <home>/kv
    disk_bytes: int = 20 * 1024**3
    redis_url: str | None = None
    redis_timeout_s: float = 0.5
    redis_cluster: bool = False  # redis_url is a node of a Redis / Valkey cluster
    # The S3 tier (cold, after disk and Redis): s3://bucket/prefix, an endpoint for S3-compatible
    # stores (MinIO, Ceph, moto; none = AWS), credentials from boto3's usual chain.
    s3_url: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_timeout_s: float = 2.0
    s3_codec: str | None = None
    s3_codec_level: int = 0
    write_queue: int = 64
    store_generated: bool = False  # without history: store the answers' whole chunks too
    salt: str = ""
    history: bool = True  # whole-history reuse: a turn's prompt and answer KV kept for the next turn
    history_records: int = 2048  # stored histories whose ids are remembered (to line up later turns)
    truncation: str = "reuse"  # a conversation beyond the context window: reuse | recompute | off
    async_save: bool = True  # save new KV on a thread of its own, off the request path
    prefetch: bool = True  # read queued requests' KV from disk / Redis into memory before they run
    eviction: str = "queue"  # memory tier: queue (keep queued requests' entries) | lru
    # Per-tier codecs: the memory tier writes ``codec``; disk and Redis write their own when set
    # (e.g. cachegen), else the same. Readers accept any codec, whatever wrote an entry.
    disk_codec: str | None = None
    disk_codec_level: int = 0
    redis_codec: str | None = None
    redis_codec_level: int = 0
    stream_levels: tuple[int, ...] = ()  # extra CacheGen levels written to disk / Redis for streaming
    kv_slo_ms: float | None = None  # load slow-tier KV adaptively within this budget (None: off)
    codec_workers: int | None = None  # processes that encode / decode CacheGen (None: one per core)
    # How long the entries a request writes stay when it does not say (prompt_cache_retention):
    # none = the tiers' policy (every tier, until evicted), in_memory, or a duration such as 24h.
    retention: str | None = None


@dataclass(frozen=True)
class BlendConfig:
    """How prompts with documents are blended (CacheBlend); see ``kvfuse.blend.options``.

    The same fields and defaults as ``BlendOptions``, written out because this module cannot import
    the blend package at import time (``models.registry`` imports it); a unit test keeps them equal."""

    recompute_ratio: float = 0.15
    method: str = "hkvd"
    check_layer: int = 1
    deviation: str = "v"
    gradual: bool = False
    sink_tokens: int = 4
    document_context: str = "bos"
    store_blended: bool = True

    def options(self):
        from .blend.options import BlendOptions

        return BlendOptions(**dataclasses.asdict(self))


@dataclass(frozen=True)
class EngineConfig:
    """Continuous batching: how many sequences share a step, and the live KV they may hold."""

    max_running: int = 32  # sequences decoded / prefilled together in one step
    max_step_tokens: int = 256  # tokens per forward pass: decodes first, then prompt chunks
    kv_memory_bytes: int | None = 4 * 1024**3  # live KV of all running sequences together (None: unbounded)


@dataclass(frozen=True)
class ResponsesConfig:
    """Stored responses of the Responses API (what ``previous_response_id`` names)."""

    store: bool = True  # keep responses whose request says store: true (false: keep none)
    path: str | None = None  # the SQLite file; default: <home>/responses.sqlite3
    ttl: str = "30d"  # a stored response expires this long after it was created

    @property
    def ttl_s(self) -> float:
        from .durations import parse_duration

        return parse_duration(self.ttl)


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # "KEY:TENANT" entries; empty = no authentication
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024**2
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256


@dataclass(frozen=True)
class Config:
    """Everything kvfuse reads. Build it with ``load_config``; it never changes afterwards."""

    home: str = ""  # "" -> ~/.cache/kvfuse
    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # auto (the compute dtype) | int8 (CPU only; its own cache namespace)
    threads: int = 0  # 0 = all cores
    context_tokens: int = 0  # the context window; 0 = the model's (lower it to truncate conversations sooner)
    tune_malloc: bool = True  # keep freed multi-MB buffers for reuse (see runtime.tune_allocator)
    log_level: str = "info"
    cache: CacheConfig = field(default_factory=CacheConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser() if self.home else Path.home() / ".cache" / "kvfuse"

    @property
    def disk_path(self) -> Path:
        return Path(self.cache.disk_path).expanduser() if self.cache.disk_path else self.home_path / "kv"

    @property
    def responses_path(self) -> Path:
        return Path(self.responses.path).expanduser() if self.responses.path else self.home_path / "responses.sqlite3"

    def api_key_map(self) -> dict[str, str]:
        return dict(entry.split(":", 1) for entry in self.server.api_keys)


_SECTIONS = {"cache": CacheConfig, "blend": BlendConfig, "engine": EngineConfig, "responses": ResponsesConfig,
             "server": ServerConfig}


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge defaults, the YAML file, ``KVFUSE_*`` variables of ``env`` and ``overrides``.

    ``overrides`` uses dotted names (``{"cache.chunk_size": 512, "model": "gemma3-270m"}``); values
    that are None are ignored (an unset CLI flag). ``path`` defaults to ``$KVFUSE_CONFIG``.
    """
    env = dict(env or {})
    values: dict[str, tuple[Any, str]] = {}  # dotted field -> (raw value, where it came from)
    path = path or env.get("KVFUSE_CONFIG")
    if path:
        values.update(_from_file(Path(path)))
    values.update(_from_env(env))
    for name, value in (overrides or {}).items():
        if value is not None:
            _known(name, "command line")
            values[name] = (value, "command line")
    return _build(values)


def _from_file(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}; check the path given to --config / KVFUSE_CONFIG") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: in {path} must be a mapping of {key} settings")
            for sub, v in value.items():
                out[_known(f"{key}.{sub}", str(path))] = (v, str(path))
        elif isinstance(value, dict):
            raise ConfigError(f"unknown section {key!r} in {path}; sections: {', '.join(_SECTIONS)}")
        else:
            out[_known(str(key), str(path))] = (value, str(path))
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for f in dataclasses.fields(Config):
        if f.name in _SECTIONS:
            for sub in dataclasses.fields(_SECTIONS[f.name]):
                var = f"KVFUSE_{f.name.upper()}_{sub.name.upper()}"
                if var in env:
                    out[f"{f.name}.{sub.name}"] = (env[var], var)
        elif (var := f"KVFUSE_{f.name.upper()}") in env:
            out[f.name] = (env[var], var)
    return out


def _known(name: str, source: str) -> str:
    """``name`` if it is a setting; otherwise a ConfigError listing the valid ones."""
    section, dot, leaf = name.partition(".")
    if dot:
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section {section!r} in {name!r} (from {source}); sections: {', '.join(_SECTIONS)}")
        valid, where = [f.name for f in dataclasses.fields(_SECTIONS[section])], f"in section {section!r}"
    else:
        valid, where, leaf = [f.name for f in dataclasses.fields(Config) if f.name not in _SECTIONS], "at top level", name
    if leaf not in valid:
        sections = "" if dot else f"; sections: {', '.join(_SECTIONS)}"
        raise ConfigError(f"unknown setting {name!r} (from {source}); valid settings {where}: {', '.join(valid)}{sections}")
    return name


def _build(values: dict[str, tuple[Any, str]]) -> Config:
    sections = {}
    for sec, cls in _SECTIONS.items():
        kwargs = {f.name: _coerce(f"{sec}.{f.name}", f.type, *values[f"{sec}.{f.name}"])
                  for f in dataclasses.fields(cls) if f"{sec}.{f.name}" in values}
        sections[sec] = cls(**kwargs)
    top = {f.name: _coerce(f.name, f.type, *values[f.name])
           for f in dataclasses.fields(Config) if f.name in values and f.name not in _SECTIONS}
    config = Config(**top, **sections)
    _validate(config, {name: source for name, (_, source) in values.items()})
    return config


def _coerce(name: str, typ: str, value: Any, source: str) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise a ConfigError naming the fix."""
    def fail(expected: str, example: str):
        raise ConfigError(f"{name}: expected {expected}, got {value!r} (from {source}); for example {example}")

    is_size = name.endswith("_bytes")
    base = typ.replace(" | None", "")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null") and "None" in typ):
        if "None" in typ:
            return None
        fail(f"a value for {base}", "remove the empty setting")
    if base == "bool":
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        fail("true or false", f"{name.split('.')[-1]}: true")
    if base == "int":
        if is_size:
            return _size(name, value, source)
        if isinstance(value, bool):
            fail("an integer", f"{name.split('.')[-1]}: 256")
        try:
            return int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            fail("an integer", f"{name.split('.')[-1]}: 256")
    if base == "float":
        try:
            f = float(value)
        except (TypeError, ValueError):
            f = math.nan
        if isinstance(value, bool) or not math.isfinite(f):
            fail("a number", f"{name.split('.')[-1]}: 0.5")
        return f
    if base.startswith("tuple"):
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, int) and not isinstance(items, bool):
            items = [items]
        if not isinstance(items, (list, tuple)):
            fail("a list", f"{name.split('.')[-1]}: [a, b]")
        strings = tuple(str(i).strip() for i in items if str(i).strip())
        if base == "tuple[int, ...]":
            try:
                return tuple(int(i) for i in strings)
            except ValueError:
                fail("a list of integers", f"{name.split('.')[-1]}: [1, 3]")
        return strings
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        fail("a string", f"{name.split('.')[-1]}: text")
    return str(value)


def _size(name: str, value: Any, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        unit = (m.group(2) or "").lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{name}: expected a size such as 512MiB, 2GiB or a number of bytes, got {value!r} (from {source})")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative (from {source})")
    return n


def _validate(c: Config, sources: Mapping[str, str]) -> None:
    """Range and consistency checks; ``sources`` says where each non-default value came from."""

    def need(ok: bool, name: str, message: str):
        if not ok:
            where = f" (from {sources[name]})" if name in sources else " (the default)"
            raise ConfigError(f"{name}: {message}{where}")

    need(c.device in ("auto", "cpu", "cuda") or c.device.startswith("cuda:"), "device", f"must be auto, cpu or cuda[:N], got {c.device!r}")
    need(c.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", f"must be auto, float32, bfloat16 or float16, got {c.dtype!r}")
    need(c.weights in WEIGHT_FORMATS, "weights",
         f"must be one of {', '.join(WEIGHT_FORMATS)} (auto = the compute dtype, int8 = int8 projections on CPU), "
         f"got {c.weights!r}")
    need(c.weights == "auto" or not c.device.startswith("cuda"), "weights",
         f"int8 runs on the CPU only (PyTorch's fbgemm kernels), not on device {c.device!r}; use weights: auto "
         "with a GPU, or device: cpu")
    need(c.threads >= 0, "threads", "must be >= 0 (0 = all cores)")
    need(c.log_level.lower() in ("debug", "info", "warning", "error"), "log_level", "must be debug, info, warning or error")
    need(bool(c.model), "model", "must name a built-in model, a model folder or a .gguf file")
    k = c.cache
    e = c.engine
    need(e.max_running >= 1, "engine.max_running", f"must be >= 1 sequences per step, got {e.max_running}")
    need(e.max_step_tokens >= 1, "engine.max_step_tokens", f"must be >= 1 token per step, got {e.max_step_tokens}")
    need(e.kv_memory_bytes is None or e.kv_memory_bytes > 0, "engine.kv_memory_bytes",
         "must be a size > 0 (e.g. 1GiB), or none for no limit")
    need(16 <= k.chunk_size <= 65536, "cache.chunk_size", f"must be between 16 and 65536 tokens, got {k.chunk_size} (256 is the default)")
    need(k.kv_dtype in KV_DTYPES, "cache.kv_dtype", f"must be one of {', '.join(KV_DTYPES)}, got {k.kv_dtype!r}")
    need(k.codec_level >= 0, "cache.codec_level", "must be >= 0")
    need(k.write_queue >= 1, "cache.write_queue", "must be >= 1")
    need(k.redis_timeout_s > 0, "cache.redis_timeout_s", "must be > 0 seconds")
    need(k.history_records >= 0, "cache.history_records", "must be >= 0 (0: remember no histories' ids)")
    need(k.truncation in ("reuse", "recompute", "off"), "cache.truncation",
         f"must be reuse, recompute or off, got {k.truncation!r}")
    need(k.eviction in ("queue", "lru"), "cache.eviction", f"must be queue or lru, got {k.eviction!r}")
    need(c.context_tokens == 0 or c.context_tokens >= 16, "context_tokens",
         f"must be 0 (the model's context window) or at least 16 tokens, got {c.context_tokens}")
    need(k.redis_url is None or k.redis_url.startswith(("redis://", "rediss://", "unix://")), "cache.redis_url",
         f"must start with redis://, rediss:// or unix://, got {k.redis_url!r}")
    b = c.blend
    from .blend.options import CONTEXTS, DEVIATIONS, METHODS

    need(0.0 <= b.recompute_ratio <= 1.0, "blend.recompute_ratio", f"must be in [0, 1], got {b.recompute_ratio}")
    need(b.method in METHODS, "blend.method", f"must be one of {', '.join(METHODS)}, got {b.method!r}")
    need(b.deviation in DEVIATIONS, "blend.deviation", f"must be k or v, got {b.deviation!r}")
    need(b.check_layer >= 0, "blend.check_layer", "must be >= 0 (a layer index)")
    need(b.sink_tokens >= 0, "blend.sink_tokens", "must be >= 0")
    need(b.document_context in CONTEXTS, "blend.document_context",
         f"must be one of {', '.join(CONTEXTS)}, got {b.document_context!r}")
    s = c.server
    need(1 <= s.port <= 65535, "server.port", f"must be in 1..65535, got {s.port}")
    need(s.max_queue >= 1, "server.max_queue", "must be >= 1")
    need(s.max_body_bytes >= 1024, "server.max_body_bytes", "must be at least 1KiB")
    need(1 <= s.default_max_tokens <= s.max_tokens_limit, "server.default_max_tokens", "must be between 1 and server.max_tokens_limit")
    for entry in s.api_keys:
        key, sep, tenant = entry.partition(":")
        need(bool(sep and key and tenant), "server.api_keys", f"entries must look like KEY:TENANT, got {entry!r}")
    from .codecs import codec_names, get_codec

    need(k.codec in codec_names(), "cache.codec", f"unknown codec {k.codec!r}; known codecs: {', '.join(codec_names())}")
    need(k.s3_url is None or (k.s3_url.startswith("s3://") and len(k.s3_url) > 5), "cache.s3_url",
         f"must look like s3://BUCKET or s3://BUCKET/PREFIX, got {k.s3_url!r}")
    need(k.s3_timeout_s > 0, "cache.s3_timeout_s", "must be > 0 seconds")
    for tier in ("", "disk_", "redis_", "s3_"):
        name = getattr(k, f"{tier}codec")
        if name is None:
            continue
        need(name in codec_names(), f"cache.{tier}codec",
             f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}")
        try:
            get_codec(name, getattr(k, f"{tier}codec_level"))
        except ValueError as e:
            need(False, f"cache.{tier}codec_level", str(e))
    from .codecs.cachegen import LEVELS

    need(all(level in LEVELS for level in k.stream_levels), "cache.stream_levels",
         f"must be CacheGen levels ({', '.join(map(str, LEVELS))}), got {list(k.stream_levels)}")
    need(k.kv_slo_ms is None or k.kv_slo_ms > 0, "cache.kv_slo_ms", f"must be > 0 milliseconds, got {k.kv_slo_ms}")
    need(k.codec_workers is None or k.codec_workers >= 0, "cache.codec_workers",
         "must be >= 0 (0: code in the calling process)")
    from .durations import parse_duration
    from .engine.retention import Retention

    if k.retention is not None:
        try:
            Retention.parse(k.retention)
        except ValueError as e:
            need(False, "cache.retention", f"{e} (or none: the tiers' policy)")
    try:
        parse_duration(c.responses.ttl)
    except ValueError as e:
        need(False, "responses.ttl", str(e))


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """The kvfuse home when none is given: ``$KVFUSE_HOME`` (of ``env``, default this process's
    environment) or ``~/.cache/kvfuse``. For code that loads models without a ``Config``."""
    env = os.environ if env is None else env
    return Path(env["KVFUSE_HOME"]).expanduser() if env.get("KVFUSE_HOME") else Path.home() / ".cache" / "kvfuse"


def load_from_environment(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """``load_config`` with this process's environment (the CLI's entry point)."""
    return load_config(path, os.environ, overrides)
