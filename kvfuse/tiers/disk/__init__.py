"""The disk tier: one file per entry, atomic writes, LRU by bytes, shareable between processes.

Layout, from the tier down to its files:

- ``tier``     ``DiskTier``: its index, capacity and eviction, and the ``Tier`` operations
- ``scan``     the start-up scan that rebuilds the LRU index from the files
- ``expiry``   per-entry expiries tied to files; ``journal`` their journal (``expiry.log``)
- ``files``    where an entry's file lives, staged writes renamed into place, reads, listings
"""

from kvfuse.tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
