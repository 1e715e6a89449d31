"""Storage tiers (memory, disk, Redis/Valkey, S3) behind one interface, and the tiered store over them."""

from kvfuse.tiers.base import Blob, Tier, TierStats
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.memory import MemoryTier
from kvfuse.tiers.redis import RedisTier
from kvfuse.tiers.store import (
    Encoded,
    Fetched,
    LayerRange,
    LookupResult,
    StoreCounters,
    TieredStore,
)

__all__ = [
    "Blob",
    "DiskTier",
    "Encoded",
    "Fetched",
    "LayerRange",
    "LookupResult",
    "MemoryTier",
    "RedisTier",
    "StoreCounters",
    "Tier",
    "TierStats",
    "TieredStore",
]
