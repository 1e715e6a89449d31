"""Readable typed keys for tier tests: ``K("a")`` is a fixed ``ChunkKey`` named "a" in namespace "ns".

Tiers take ``ChunkKey`` objects only; these stand in for the short string names the tests use, and
``ns_prefix("ns1")`` is the ``delete_prefix`` argument that selects namespace "ns1".
"""

from __future__ import annotations

import hashlib

from kvfuse.kv.keys import ChunkKey, ChunkKind


def ns_id(ns: str) -> str:
    return hashlib.sha256(b"test-ns\0" + ns.encode()).hexdigest()[:48]


def K(name: str, ns: str = "ns", kind: ChunkKind = ChunkKind.PREFIX) -> ChunkKey:
    return ChunkKey(ns_id(ns), hashlib.sha256(name.encode()).digest(), kind)


def Ks(*names: str) -> list[ChunkKey]:
    return [K(n) for n in names]


def ns_prefix(ns: str) -> str:
    return ns_id(ns) + ":"
