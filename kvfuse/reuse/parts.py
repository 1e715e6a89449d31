"""The collaborators of one cache engine, built once by ``CacheEngine`` and shared by the parts
that plan, load, write and precompute (``Prefiller``, ``offline``): one object to pass instead of
ten constructor arguments, and the one place that says what the cache engine is made of."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfuse.codecs.base import Codec
from kvfuse.models.transformer import Transformer
from kvfuse.store import TieredStore

from .cache_writer import CacheWriter
from .keying import Keying
from .kv_stream import LoadEstimates
from .saver import Saver, SyncSaver
from .stats import ReuseStats


@dataclass(frozen=True)
class Parts:
    runner: Transformer
    store: TieredStore
    saver: Saver | SyncSaver
    keying: Keying
    writer: CacheWriter
    codec: Codec  # what the engine encodes its new entries with
    kv_dtype: torch.dtype
    kv_slo_ms: float | None  # the engine's budget for loading KV from slow tiers
    stats: ReuseStats
    estimates: LoadEstimates  # measured rates the KV stream chooses by
