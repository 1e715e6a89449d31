"""The seed of each of a request's ``n`` choices.

Choice 0 uses the request's seed itself, so ``n: 1`` samples exactly as before; choice ``i > 0``
a seed derived from the seed and ``i`` by a hash (not ``seed + i``: request seeds 1 and 2 would
then share choices), so a seeded request with ``n`` choices gives the same ``n`` outputs every
time. Without a seed every choice draws its own random seed.
"""

from __future__ import annotations

import hashlib

SEED_LIMIT = 2**63


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed`` (None: unseeded)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"kvfuse-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT
