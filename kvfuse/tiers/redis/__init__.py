"""The Redis / Valkey tier (a single server or a cluster).

Layout:

- ``tier``        ``RedisTier``: entries as Redis values, bounded calls, back-off while away
- ``connection``  bounded calls, unjoined values on the wire, the (cluster) client and its TLS
"""

from kvfuse.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
