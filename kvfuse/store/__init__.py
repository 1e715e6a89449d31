"""The tiered store: the memory tier, then the lower tiers, as one cache of KV entries.

Layout, in the order a read and a write go through it:

- ``core``           ``TieredStore``: the tiers by role; lookup, fetch, promote, put, extend, delete
- ``lookups``        the walks down the tiers, fastest first: where keys are, their first usable
                     copies, their expiries below memory
- ``checked_reads``  the one validation path for everything read back from a tier
- ``results``        what the store answers with: ``LookupResult``, ``Fetched``, ``Encoded``,
                     ``LayerRange``, and its counters (``StoreCounters``)
- ``write_behind``   the bounded queue and thread writing to the lower tiers
- ``transcode``      per-tier codecs and CacheGen variants, re-encoded on the way down
- ``prefetch``       queued requests' KV read into memory before they run; ``prefetch_tally``
                     what it achieved
- ``tenant_quota``   per-tenant byte quotas, given to the memory and disk tiers (whose eviction
                     policy applies them: ``kvfuse/tiers/eviction.py``)

The tiers themselves (memory, disk, Redis, S3) are backends in ``kvfuse.tiers``: this package
imports them, never the reverse.
"""

from kvfuse.store.core import TieredStore
from kvfuse.store.prefetch import Prefetcher
from kvfuse.store.results import Encoded, Fetched, LayerRange, LookupResult, StoreCounters
from kvfuse.store.tenant_quota import TenantQuotas

__all__ = [
    "Encoded",
    "Fetched",
    "LayerRange",
    "LookupResult",
    "Prefetcher",
    "StoreCounters",
    "TenantQuotas",
    "TieredStore",
]
