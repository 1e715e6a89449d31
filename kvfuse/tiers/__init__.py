"""Storage tiers: byte stores keyed by ``ChunkKey`` behind one interface (the tiered store over
them is ``kvfuse.store``).

Layout: the interface, then the tiers, fastest first, each with what it is made of:

- ``base``       the tier interface (``Tier``), its counters, expiry bookkeeping; ``IndexedTier``,
                 what the memory and disk tiers share
- ``memory``     the memory tier: LRU by bytes, queue-aware, per-tenant quotas
- ``eviction``   which entry the memory and disk tiers evict next: LRU, queued requests' entries
                 last, per-tenant quotas (the one eviction policy)
- ``key_index``  the compact LRU index of the memory and disk tiers
- ``disk``       the disk tier: one file per entry, shareable between processes
- ``redis``      the Redis / Valkey tier
- ``s3``         the S3 tier (boto3 is optional: import ``kvfuse.tiers.s3`` for it)
- ``backoff``    the back-off Redis and S3 share while their server is away
- ``delegating`` ``DelegatingTier``: everything forwarded to an inner tier (the wrappers' base)
- ``encrypted``  ``EncryptedTier``: a lower tier's values sealed with AES-256-GCM
"""

from kvfuse.tiers.base import Blob, Tier, TierStats
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.memory import MemoryTier
from kvfuse.tiers.redis import RedisTier

__all__ = ["Blob", "DiskTier", "MemoryTier", "RedisTier", "Tier", "TierStats"]
