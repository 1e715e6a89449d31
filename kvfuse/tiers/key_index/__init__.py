"""The compact LRU index of chunk keys the memory and disk tiers hold (``index``)."""

from kvfuse.tiers.key_index.index import KeyIndex

__all__ = ["KeyIndex"]
