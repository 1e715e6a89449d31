"""The connector's configuration and cache namespace (no vLLM here).

Configuration: kvfuse's own (``kvfuse.config``: defaults < the YAML file < ``KVFUSE_*``
environment) with vLLM's ``kv_connector_extra_config`` on top. The extra config takes

- any ``cache`` setting of kvfuse by its name (``chunk_size``, ``memory_bytes``, ``disk``,
  ``disk_path``, ``disk_bytes``, ``redis_url``, ``codec``, ``codec_level``, ``disk_codec``,
  ``redis_codec``, ``salt``, ...; ``cache.chunk_size`` works too) and ``home``;
- ``config``: a kvfuse YAML file (else ``$KVFUSE_CONFIG``);
- the connector's own switches: ``load`` and ``save`` (default true), ``layerwise`` (``auto``, the
  default: layer by layer while the forward pass runs when vLLM's KV cache is on a GPU, whole
  entries before the forward pass when it is on the CPU, where a loader thread competes with the
  forward pass for the same cores; ``true`` / ``false`` force one), ``model_fingerprint`` (name the weights
  yourself, e.g. when two servers hold the same model at different paths), ``save_queue``
  (chunks waiting to be encoded and stored before new saves are dropped; default 64).

Namespace (what must match for a stored chunk to be valid, see ``kv/keys.py``): a model
fingerprint derived from what vLLM gives the connector (model name or folder, revision, dtype,
quantization, the model config, and for a local folder the weight files: names, sizes and sampled
bytes), prefixed so that it never equals kvfuse's own engine's (other kernels: not bit-identical
KV); the KV dtype of vLLM's cache; the layout (layers, KV heads and head size per tensor-parallel
rank, and the rank); kvfuse's ``salt`` and the request's ``cache_salt``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvfuse.config import CacheConfig, Config, ConfigError, load_from_environment
from kvfuse.kv.keys import Namespace, layout_of

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_TOP_FIELDS = {"home"}
_BOOL_OPTIONS = {"load": True, "save": True}
_OTHER_OPTIONS = {"config", "layerwise", "model_fingerprint", "save_queue"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SOURCE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector reads: kvfuse's configuration and its own switches."""

    config: Config
    load: bool = True
    save: bool = True
    layerwise: bool | None = None  # None: auto (layer by layer on a GPU, whole entries on the CPU)
    model_fingerprint: str | None = None
    save_queue: int = 64

    @property
    def chunk_size(self) -> int:
        return self.config.cache.chunk_size


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    choices = "true, false or auto" if name == "layerwise" else "true or false"
    raise ConfigError(f"{name}: expected {choices}, got {value!r} (from {_SOURCE})")


def read_settings(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """The settings of ``kv_connector_extra_config`` over kvfuse's configuration (the YAML file
    named by ``config`` or ``$KVFUSE_CONFIG``, then ``KVFUSE_*`` variables of ``env``, default
    this process's environment, read by ``kvfuse.config``); ConfigError naming the setting on
    anything unknown or invalid."""
    options, overrides = _split_extra(dict(extra or {}))
    try:
        config = load_from_environment(options.get("config"), overrides, env)
    except ConfigError as e:
        raise ConfigError(str(e).replace("(from command line)", f"(from {_SOURCE})")) from None
    if not config.cache.enabled:
        raise ConfigError(
            "cache.enabled is false: remove the kvfuse connector from --kv-transfer-config instead"
        )
    return _connector_settings(config, options)


def _split_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kv_connector_extra_config`` split into the connector's own switches (booleans read) and
    kvfuse settings as ``load_from_environment`` overrides (``cache.`` added where it is left
    out); ConfigError listing the valid names on an unknown one."""
    options: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for key, value in extra.items():
        name = key.removeprefix("cache.") if key.startswith("cache.") else key
        if key in _BOOL_OPTIONS:
            options[key] = _as_bool(key, value)
        elif key in _OTHER_OPTIONS:
            options[key] = value
        elif name in _CACHE_FIELDS:
            overrides[f"cache.{name}"] = value
        elif key in _TOP_FIELDS:
            overrides[key] = value
        else:
            valid = (
                sorted(_BOOL_OPTIONS)
                + sorted(_OTHER_OPTIONS)
                + sorted(_TOP_FIELDS)
                + sorted(_CACHE_FIELDS)
            )
            raise ConfigError(
                f"unknown setting {key!r} in {_SOURCE}; valid settings: {', '.join(valid)}"
            )
    return options, overrides


def _connector_settings(config: Config, options: dict[str, Any]) -> ConnectorSettings:
    """The connector's own switches checked (``model_fingerprint`` a non-empty string,
    ``layerwise`` a boolean or auto, ``save_queue`` a positive integer), with ``config``."""
    fingerprint = options.get("model_fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint.strip()):
        raise ConfigError(
            f"model_fingerprint: expected a non-empty string, got {fingerprint!r} (from {_SOURCE})"
        )
    layerwise = options.get("layerwise", "auto")
    if isinstance(layerwise, str) and layerwise.strip().lower() == "auto":
        layerwise = None
    else:
        layerwise = _as_bool("layerwise", layerwise)
    queue = options.get("save_queue", 64)
    try:
        queue = int(queue)
    except (TypeError, ValueError):
        queue = 0
    if isinstance(options.get("save_queue"), bool) or queue < 1:
        raise ConfigError(
            f"save_queue: expected an integer >= 1, got {options.get('save_queue')!r} (from {_SOURCE})"
        )
    return ConnectorSettings(
        config,
        load=options.get("load", True),
        save=options.get("save", True),
        layerwise=layerwise,
        model_fingerprint=fingerprint,
        save_queue=queue,
    )


def weights_digest(
    folder: str | Path, samples: int = 8, sample_bytes: int = 64 * 1024
) -> str | None:
    """A digest of a model folder's weight files, cheap even for huge models: each file's name and
    size, and ``samples`` slices of ``sample_bytes`` spread over it (first and last included).
    Different weights (a fine-tune, another quantization) differ in these bytes; reading them
    costs milliseconds. None if ``folder`` is not a folder holding weight files."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        return None
    h = hashlib.sha256(b"kvfuse.vllm.weights.v1\x00")
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\x00{size}\x00".encode())
        with open(path, "rb") as f:
            span = max(0, size - sample_bytes)
            for i in range(samples):
                f.seek(span * i // max(1, samples - 1))
                h.update(f.read(sample_bytes))
    return h.hexdigest()


def model_fingerprint(
    model: str,
    *,
    revision: str | None = None,
    dtype: str = "",
    quantization: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    weights: str | None = None,
) -> str:
    """The model's identity in the connector's cache keys. Prefixed ``vllm-``: kvfuse's own engine
    (other kernels) never shares keys with vLLM."""
    h = hashlib.sha256(b"kvfuse.vllm.model.v1\x00")
    config = json.dumps(hf_config or {}, sort_keys=True, default=str)
    for part in (model, revision or "", dtype, quantization or "", config, weights or ""):
        h.update(part.encode() + b"\x00")
    return "vllm-" + h.hexdigest()[:32]


def kv_namespace(
    fingerprint: str,
    kv_dtype: str,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    *,
    salt: str = "",
    cache_salt: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Namespace:
    """The namespace of one tensor-parallel rank's entries: the layout names the rank's KV heads
    (and the rank, with several); ``cache_salt`` (vLLM's per-request salt) goes into the salt, as
    in kvfuse's own server."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    layout = layout_of(num_layers, kv_heads, head_dim)
    if tp_size > 1:
        layout += f"/tp{tp_rank}of{tp_size}"
    full_salt = salt + ("\x00" + cache_salt if cache_salt else "")
    return Namespace(
        model_fingerprint=fingerprint,
        kv_dtype=kv_dtype,
        kv_layout=layout,
        salt=full_salt,
        cache_salt=cache_salt or "",
    )
