"""Assemble the running parts from a ``Config``: the tiered store, the model, the prompt builder,
the engine. The prompt builder is made here, once per model, and handed to the engine (which
checks prompts against the context window and reports truncations) and to the server and CLI
(which build prompts with it): nothing reads it through the engine."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import heap
from .codecs import get_codec
from .config import Config, TierConfig
from .config.encryption import cipher_of
from .config.secrets import read_secret
from .config.signing import signer_of
from .config.tenants import tier_quotas
from .engine import Engine
from .entropy.pool import set_shared_pool, shared_pool
from .kv.keys import tenant_tag
from .models import LoadedModel, load_model
from .prompts import PromptBuilder
from .store import TieredStore
from .store.tenant_quota import TenantQuotas
from .threads import set_compute_threads, use_compute_threads
from .tiers.base import Tier
from .tiers.disk import DiskTier
from .tiers.encrypted import EncryptedTier
from .tiers.memory import MemoryTier
from .tiers.redis import RedisTier
from .tiers.redis.connection import Security

log = logging.getLogger(__name__)


def open_store(config: Config, clock: Callable[[], float] | None = None) -> TieredStore | None:
    """The memory tier (when the cache is enabled) and the tiers below it, in order
    (``Config.lower_tiers``: ``cache.tiers``, or the flat keys: disk unless disabled, then Redis
    and S3 when their URLs are set). ``clock``: the wall clock entries expire by (tests inject one).
    With signing keys (``cache.signing_key``...), the store signs what it writes to the lower tiers
    and checks what it reads back (``config.signing.signer_of``; a ConfigError for a bad key);
    with ``cache.encryption_key_file``, the lower tiers are wrapped in ``EncryptedTier``."""
    c = config.cache
    if not c.enabled:
        return None
    signer = signer_of(c)
    if c.codec_workers is not None:
        set_shared_pool(c.codec_workers)
    lower = [open_tier(t, tenant_quotas(config, t.tier_name)) for t in config.lower_tiers()]
    cipher = cipher_of(c)
    if cipher is not None and lower:
        # seal below memory (sign, then encrypt: the signer sees plaintext); the count, never a key
        lower = [EncryptedTier(t, cipher) for t in lower]
        log.info("cache entries below memory are encrypted (AES-256-GCM, %r)", cipher)
    codecs = {
        t.tier_name: get_codec(t.codec, t.codec_level)
        for t in config.lower_tiers()
        if t.codec is not None
    }
    stream_levels = c.stream_levels if lower else ()
    if stream_levels or c.codec == "cachegen" or any(x.name == "cachegen" for x in codecs.values()):
        shared_pool().warm()  # CacheGen codes in worker processes: start them before the first request
    if signer is not None:
        # the count, never a key
        log.info("cache entries below memory are signed and checked (%r)", signer)
    memory = MemoryTier(c.memory_bytes, quotas=tenant_quotas(config, "memory"))
    return TieredStore(
        memory,
        lower,
        write_queue_size=c.write_queue,
        codecs=codecs,
        stream_levels=stream_levels,
        clock=clock,
        signer=signer,
    )


def tenant_quotas(config: Config, tier: str) -> TenantQuotas | None:
    """The per-tenant byte quotas of the tier named ``tier`` (``tenants:``), by tenant tag; None
    when no tenant has one there."""
    named, default = tier_quotas(config.tenants, tier)
    if not named and default is None:
        return None
    return TenantQuotas({tenant_tag(name): limit for name, limit in named.items()}, default)


def open_tier(t: TierConfig, quotas: TenantQuotas | None = None) -> Tier:
    """The tier a ``cache.tiers`` section describes (``quotas``: a disk tier's per-tenant quotas)."""
    if t.kind == "disk":
        return DiskTier(t.path, t.capacity, name=t.tier_name, quotas=quotas)
    if t.kind == "redis":
        return RedisTier(
            t.url,
            timeout_s=t.timeout,
            cluster=t.cluster,
            name=t.tier_name,
            security=redis_security(t),
        )
    from .tiers.s3 import S3Tier  # boto3 is an optional dependency (kvfuse[s3])

    return S3Tier(
        t.url,
        endpoint_url=t.endpoint,
        region=t.region,
        timeout_s=t.timeout,
        name=t.tier_name,
        sse=t.sse,
        sse_kms_key_id=t.sse_kms_key_id,
    )


def redis_security(t: TierConfig) -> Security:
    """A Redis tier's ACL user, its password (read now from its variable or file) and TLS files."""
    password = read_secret(
        f"the {t.tier_name} tier's password", env_var=t.password_env, path=t.password_file
    )
    files = [
        os.path.expanduser(f) if f else None
        for f in (t.tls_ca_file, t.tls_cert_file, t.tls_key_file)
    ]
    return Security(t.username, password, *files)


def set_threads(config: Config) -> None:
    """The engine's thread count (``kvfuse.threads``): the configured one, else PyTorch's."""
    if config.threads:
        set_compute_threads(config.threads)
    else:
        use_compute_threads()


def open_model(config: Config) -> LoadedModel:
    """The configured model, its CPU backend chosen from ``kernels`` (named in the log)."""
    model = load_model(
        config.model,
        home=config.home_path,
        device=config.device,
        dtype=config.dtype,
        weights=config.weights,
        kernels=config.kernels,
    )
    r = model.runner
    log.info(
        "model %s on %s in %s: %s",
        model.name,
        r.device,
        _dtype_name(r.dtype),
        model.backend.describe(),
    )
    if r.device.type == "cpu":
        from .models.cpu import kernels

        log.info("CPU %s: %s", kernels.cpu_model() or "(model unknown)", kernels.cpu_line())
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_prompts(config: Config, model: LoadedModel) -> PromptBuilder:
    """The prompt builder of ``model`` within the configured context window."""
    truncate = config.cache.truncation != "off"
    s = config.server
    return PromptBuilder.for_model(
        model, config.context_tokens, truncate, s.max_chat_messages, s.max_chat_chars
    )


def open_engine(
    config: Config,
    model: LoadedModel | None = None,
    store: TieredStore | None = None,
    clock: Callable[[], float] | None = None,
    prompts: PromptBuilder | None = None,
) -> Engine:
    """An engine over ``model`` (loaded from the config if not given) and ``store`` (likewise, with
    ``clock`` for the entries' expiry), with ``prompts`` (made for the model if not given)."""
    set_threads(config)
    if config.tune_malloc:
        heap.tune()
    model = model or open_model(config)
    if store is None:
        store = open_store(config, clock)
    prompts = prompts or open_prompts(config, model)
    return Engine(model, store, config.engine_settings(), prompts)


@dataclass(frozen=True)
class Serving:
    """An engine and the prompt builder it shares with whoever builds its requests."""

    engine: Engine
    prompts: PromptBuilder


def open_serving(
    config: Config, model: LoadedModel | None = None, clock: Callable[[], float] | None = None
) -> Serving:
    """The engine and prompt builder a server (or the CLI) runs on."""
    model = model or open_model(config)
    prompts = open_prompts(config, model)
    return Serving(open_engine(config, model, clock=clock, prompts=prompts), prompts)
