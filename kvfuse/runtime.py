"""Assemble the running parts from a ``Config``: the tiered store, the model, the engine."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import torch

from .config import Config
from .engine import Engine, Retention
from .models import LoadedModel, load_model
from .tiers.disk import DiskTier
from .codecs import get_codec
from .entropy.pool import set_shared_pool, shared_pool
from .tiers.memory import MemoryTier
from .tiers.redis import RedisTier
from .tiers.store import TieredStore

log = logging.getLogger(__name__)


def open_store(config: Config, clock: Callable[[], float] | None = None) -> TieredStore | None:
    """Memory tier always (when the cache is enabled), disk unless disabled, Redis and S3 (in that
    order) when their URLs are set.
    ``clock``: the wall clock entries expire by (tests inject one)."""
    c = config.cache
    if not c.enabled:
        return None
    if c.codec_workers is not None:
        set_shared_pool(c.codec_workers)
    tiers = [MemoryTier(c.memory_bytes)]
    codecs = {}
    if c.disk:
        tiers.append(DiskTier(config.disk_path, c.disk_bytes))
        if c.disk_codec is not None:
            codecs[tiers[-1].name] = get_codec(c.disk_codec, c.disk_codec_level)
    if c.redis_url:
        tiers.append(RedisTier(c.redis_url, timeout_s=c.redis_timeout_s, cluster=c.redis_cluster))
        if c.redis_codec is not None:
            codecs[tiers[-1].name] = get_codec(c.redis_codec, c.redis_codec_level)
    if c.s3_url:
        from .tiers.s3 import S3Tier  # boto3 is an optional dependency (kvfuse[s3])

        tiers.append(S3Tier(c.s3_url, endpoint_url=c.s3_endpoint, region=c.s3_region, timeout_s=c.s3_timeout_s))
        if c.s3_codec is not None:
            codecs[tiers[-1].name] = get_codec(c.s3_codec, c.s3_codec_level)
    stream_levels = c.stream_levels if len(tiers) > 1 else ()
    if stream_levels or c.codec == "cachegen" or any(x.name == "cachegen" for x in codecs.values()):
        shared_pool().warm()  # CacheGen codes in worker processes: start them before the first request
    return TieredStore(tiers, write_queue_size=c.write_queue, codecs=codecs, stream_levels=stream_levels, clock=clock)


def set_threads(config: Config) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)


# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 2 << 30) -> bool:
    """Keep freed multi-MB buffers in the heap for reuse (glibc only; a no-op elsewhere).

    Every cache hit and store allocates a few buffers of several MB (entries, read buffers).
    By default glibc serves such sizes with fresh ``mmap``s, or trims freed heap memory back to
    the kernel, so each new buffer costs page faults on first touch: measured here, copying 16
    chunks of 6 MB ran at ~1 GB/s that way and at ~9 GB/s once freed memory is kept and reused.
    The price is that the process's resident size does not shrink after a peak (up to
    ``trim_threshold`` bytes are kept), which suits a long-running cache engine.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def open_model(config: Config) -> LoadedModel:
    return load_model(config.model, home=config.home_path, device=config.device, dtype=config.dtype,
                      weights=config.weights)


def open_engine(config: Config, model: LoadedModel | None = None, store: TieredStore | None = None,
                clock: Callable[[], float] | None = None) -> Engine:
    """An engine over ``model`` (loaded from the config if not given) and ``store`` (likewise, with
    ``clock`` for the entries' expiry)."""
    set_threads(config)
    if config.tune_malloc:
        tune_allocator()
    model = model or open_model(config)
    if store is None:
        store = open_store(config, clock)
    c = config.cache
    return Engine(
        model,
        store,
        chunk_size=c.chunk_size,
        kv_dtype=c.kv_dtype,
        codec=c.codec,
        codec_level=c.codec_level,
        store_generated=c.store_generated,
        salt=c.salt,
        max_waiting=config.server.max_queue,
        blend=config.blend.options(),
        history=c.history,
        history_records=c.history_records,
        # the ids of stored histories live next to their KV on disk, and survive restarts with it
        history_path=str(config.disk_path / "histories") if c.disk else None,
        truncation=c.truncation,
        context_tokens=config.context_tokens,
        async_save=c.async_save,
        prefetch=c.prefetch,
        eviction=c.eviction,
        kv_slo_ms=c.kv_slo_ms,
        retention=Retention.parse(c.retention) if c.retention is not None else None,
        max_running=config.engine.max_running,
        max_step_tokens=config.engine.max_step_tokens,
        kv_memory_bytes=config.engine.kv_memory_bytes,
    )
