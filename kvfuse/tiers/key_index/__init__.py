"""The compact LRU index of the chunk keys the memory and disk tiers hold (issue 15: at most 100
bytes an entry for a million entries).

Layout, from a key to its row:

- ``index``  ``KeyIndex``: the rows (digest, group, size, value), the groups and owners; put, pop,
             use, listings, the bulk load of the disk tier's start-up scan
- ``table``  the open-addressing slot table over the rows' digests: a key's row, one or a batch
- ``lists``  the recency lists over the rows: every entry's LRU order, and each owner's
"""

from kvfuse.tiers.key_index.index import KeyIndex

__all__ = ["KeyIndex"]
