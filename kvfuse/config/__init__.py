"""One frozen, validated configuration: defaults < YAML file < ``KVFUSE_*`` environment < CLI flags.

- ``sections``  the sections (frozen dataclasses) and every default; ``EngineSettings``
- ``load``      file, environment and flags -> typed values (``load_config``)
- ``validate``  ranges and consistency, errors naming the field, its source and the fix
- ``signing``   the entry signing keys (``cache.signing_key``, ``signing_keys``, ``signing_key_file``)
- ``encryption`` the keys entries below memory are encrypted with (``cache.encryption_key_file``)
- ``tenants``   the ``tenants:`` quotas; ``errors`` the ``ConfigError`` every module raises
- ``profiles``  the models' calibrated blend profiles (what ``recompute_ratio: auto`` and
  ``codec_level: 0`` mean for a model), found by fingerprint; ``kvfuse calibrate`` writes them

The file mirrors the dataclasses::

    model: smollm2
    cache:
      chunk_size: 256
      memory_bytes: 2GiB
      tiers:                      # below memory, in order (or the flat keys disk_path, redis_url, ...)
        - {kind: disk, path: /var/cache/kvfuse, capacity_bytes: 100GiB, codec: cachegen}
        - {kind: redis, url: redis://127.0.0.1:6379/0}
      signing_key_file: /etc/kvfuse/signing.keys  # sign and check disk / Redis / S3 entries (one key per line)
    blend:
      recompute_ratio: auto       # the model's calibrated budget (kvfuse calibrate), or 0..1
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
``KVFUSE_CONFIG`` for the file (``KVFUSE_CACHE_TIERS`` takes a YAML list). Only this package
reads the environment, and only when asked to (``default_home`` and ``default_kernels`` serve
code that loads a model without a ``Config``).
Every error names the field, where the bad value came from, and what to write instead.
"""

from .load import default_home, default_kernels, load_config, load_from_environment
from .sections import (
    AUTO_MODES,
    BUDGET_SOURCES,
    CONTEXTS,
    DEVIATIONS,
    KERNEL_MODES,
    KV_DTYPES,
    METHODS,
    QUERY_AWARE,
    TIER_KINDS,
    WEIGHT_FORMATS,
    BlendOptions,
    CacheConfig,
    Config,
    ConfigError,
    EngineConfig,
    EngineSettings,
    ResponsesConfig,
    ServerConfig,
    TierConfig,
)

__all__ = [
    "AUTO_MODES",
    "BUDGET_SOURCES",
    "CONTEXTS",
    "DEVIATIONS",
    "KERNEL_MODES",
    "KV_DTYPES",
    "METHODS",
    "QUERY_AWARE",
    "TIER_KINDS",
    "WEIGHT_FORMATS",
    "BlendOptions",
    "CacheConfig",
    "Config",
    "ConfigError",
    "EngineConfig",
    "EngineSettings",
    "ResponsesConfig",
    "ServerConfig",
    "TierConfig",
    "default_home",
    "default_kernels",
    "load_config",
    "load_from_environment",
]
