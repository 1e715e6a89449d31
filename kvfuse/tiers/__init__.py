"""Storage tiers (memory, disk, Redis/Valkey) behind one interface, and the tiered store over them."""

from kvfuse.tiers.base import Blob, Tier, TierStats
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.memory import MemoryTier
from kvfuse.tiers.redis import RedisTier
from kvfuse.tiers.store import Fetched, LayerRange, LookupResult, TieredStore

__all__ = ["Blob", "DiskTier", "Fetched", "LayerRange", "LookupResult", "MemoryTier", "RedisTier", "Tier", "TierStats",
           "TieredStore"]
