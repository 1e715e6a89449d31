"""The Redis / Valkey tier: pipelined batches, bounded waits, back-off while the server is away.

Every call is bounded (no client-side retries): connecting takes at most ``timeout_s``, and the
exchange that follows (sending the commands, reading every reply) at most ``timeout_s`` plus the
time its bytes take at ``min_rate`` bytes per second; how, is ``connection.py``'s part (the
tier's sockets end every read and write at the calling thread's deadline for the current call).
A failure (refused, reset, timed out) is logged once, counted, answered as a miss (writes are
dropped and counted), and starts a back-off of ``backoff_s`` during which calls return misses at
once without touching the network (``tiers/backoff.py``). The first call after the back-off tries the
server again; redis-py reconnects by itself, so the tier recovers when the server comes back.

Expiry is Redis's own: a put with ``expires_at`` is ``SET ... PX ms`` with ``ms`` the time left on
the tier's ``clock`` (the smaller of that and the tier's ``ttl_s`` where it has one); ``expiry``
is ``PTTL`` read back onto the tier's clock (``clock() + pttl / 1000``); ``extend`` is
``PEXPIRE key ms GT`` (Redis >= 7: it only lengthens, and leaves keys without a TTL alone);
``expire`` has nothing to do (0) and ``expired`` stays 0: Redis removes expired keys by itself,
on its own real clock, so with an injected (fake) clock the times are converted at the call,
not followed.

**Redis Cluster / Valkey cluster** (``cluster=True``, any node's URL): keys spread over the
cluster's hash slots (a chunk key's digest is its slot's input, so chunks spread evenly), and
every batched operation is split per node by redis-py's cluster client: pipelines are grouped by
node, ``MGET`` becomes one ``MGET`` per slot (``mget_nonatomic``), ``UNLINK``/``EXISTS`` of many
keys are split by slot, and ``SCAN`` visits every primary. A node that fails is a failure like a
single server's (counted, back-off); the client re-reads the slot map after ``MOVED``.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import redis

from kvfuse.config import CacheConfig
from kvfuse.config.secrets import redact_url
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.backoff import Backoff
from kvfuse.tiers.base import Blob, Tier, check_key, nbytes
from kvfuse.tiers.redis.connection import MIN_RATE, Security, bounded_call, make_client

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def failure_hint(error: Exception) -> str:
    """What to check after ``error``, for the log line of a failure ("" when it is no ACL or TLS
    problem: an outage speaks for itself)."""
    text = str(error)
    acl = (
        redis.exceptions.AuthenticationError,
        redis.exceptions.AuthorizationError,
        redis.exceptions.NoPermissionError,
    )
    if isinstance(error, acl) or text.startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
        return (
            "; check the ACL user and its password (redis_username, redis_password_env or "
            "redis_password_file) and the user's permissions (ACL SETUSER ... ~kvfuse:* +@all)"
        )
    if "ssl" in text.lower() or "certificate" in text.lower() or "handshake" in text.lower():
        return (
            "; check TLS: a rediss:// URL, redis_tls_ca_file (the CA that signed the server's certificate, "
            "whose name must match the URL's host), and redis_tls_cert_file with redis_tls_key_file when the "
            "server asks for client certificates"
        )
    return ""


class RedisTier(Tier):
    """Entries as Redis strings under ``key_prefix + key``; optional TTL (``ttl_s``, None = none).

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://`` for TLS, ``unix://``); with
    ``cluster``, the URL of any node of a Redis Cluster (database 0). ``min_rate``: the slowest
    transfer, in bytes per second, a call waits for beyond ``timeout_s`` (see the module docstring).
    ``security``: the ACL user and password and the TLS files (``connection.Security``). A
    wrong password, an untrusted certificate or a refused handshake is a failure like an outage:
    logged once with what to check (``failure_hint``), counted, misses and back-off.
    """

    batch_reads = True  # MGET: one round trip for a batch

    def __init__(
        self,
        url: str,
        timeout_s: float = CacheConfig.redis_timeout_s,
        key_prefix: str = "kvfuse:",
        ttl_s: float | None = None,
        backoff_s: float = 1.0,
        name: str = "redis",
        cluster: bool = CacheConfig.redis_cluster,
        min_rate: float = MIN_RATE,
        security: Security = Security(),
    ) -> None:
        super().__init__()
        if timeout_s <= 0:
            raise ValueError(f"RedisTier timeout_s must be > 0, got {timeout_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"RedisTier ttl_s must be > 0 or None (no expiry), got {ttl_s}")
        if backoff_s < 0:
            raise ValueError(f"RedisTier backoff_s must be >= 0, got {backoff_s}")
        if not min_rate > 0:
            raise ValueError(f"RedisTier min_rate must be > 0 bytes/s, got {min_rate}")
        self.name = name
        self.timeout_s = timeout_s
        self.min_rate = float(min_rate)
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.backoff_s = backoff_s
        self.cluster = cluster
        try:
            self._client = make_client(url, timeout_s, cluster, security)
        except ValueError as e:
            raise ValueError(
                f"bad Redis URL {redact_url(url)!r}: {e} (expected e.g. redis://127.0.0.1:6379/0)"
            ) from None
        except TypeError as e:  # TLS arguments with a plain redis:// or unix:// URL
            raise ValueError(
                f"Redis URL {redact_url(url)!r}: {e}; TLS settings need a rediss:// URL"
            ) from None
        self._backoff = Backoff(
            "redis tier",
            redact_url(url),
            backoff_s,
            self.stats,
            recovered="server reachable again",
            hint=failure_hint,
        )

    def is_backing_off(self) -> bool:
        """True while calls are answered as misses without trying the server."""
        return self._backoff.backing_off()

    def _k(self, key: ChunkKey) -> str:
        return self.key_prefix + str(check_key(key))

    def _call(self):
        """One bounded exchange with the server (see ``connection.bounded_call``)."""
        return bounded_call(self.timeout_s, self.min_rate)

    # -- the Tier interface ---------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        keys = list(keys)
        if not keys or not self._backoff.available():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            with self._call():
                found = [bool(n) for n in pipe.execute()]
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("contains", e)
            return [False] * len(keys)
        self._backoff.succeeded()
        return found

    def get(self, key: ChunkKey) -> Blob | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        keys = list(keys)
        if not keys:
            return []
        if not self._backoff.available():
            self.stats.add(misses=len(keys))
            return [None] * len(keys)
        try:
            with self._call():
                values = self._client.mget([self._k(k) for k in keys])
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("get", e)
            self.stats.add(misses=len(keys))
            return [None] * len(keys)
        self._backoff.succeeded()
        hits = [v for v in values if v is not None]
        self.stats.add(hits=len(hits), misses=len(keys) - len(hits), bytes_out=sum(map(len, hits)))
        return values

    def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | None:
        """GETRANGE: only the asked bytes cross the network (None on a miss or a failure)."""
        if stop <= start:
            return b""
        if not self._backoff.available():
            self.stats.add(misses=1)
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(self._k(key))
            pipe.getrange(self._k(key), start, stop - 1)
            with self._call():
                exists, value = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("getrange", e)
            self.stats.add(misses=1)
            return None
        self._backoff.succeeded()
        if not exists:
            self.stats.add(misses=1)
            return None
        self.stats.add(hits=1, bytes_out=len(value))
        return value

    def _ms_left(self, expires_at: float) -> int:
        """Milliseconds from now (on the tier's clock) until ``expires_at``, capped by ``ttl_ms``;
        <= 0 when it has passed."""
        ms = math.ceil((expires_at - self.clock()) * 1000)
        return ms if self.ttl_ms is None else min(ms, self.ttl_ms)

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        self.put_many([(key, value)], expires_at)

    def put_many(
        self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None
    ) -> None:
        items = list(items)
        if not items:
            return
        px = self.ttl_ms if expires_at is None else self._ms_left(expires_at)
        if px is not None and px <= 0:  # expired already: nothing is stored, no older value stays
            self.delete_many(k for k, _ in items)
            return
        if not self._backoff.available():
            self.stats.add(dropped_writes=len(items))
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, v in items:
                # bytes, bytearray, memoryview and an Entry's two parts go as they are (_EntryPacker)
                pipe.set(self._k(k), v, px=px)
            with self._call():
                pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("put", e)
            self.stats.add(dropped_writes=len(items))
            return
        self._backoff.succeeded()
        self.stats.add(puts=len(items), bytes_in=sum(nbytes(v) for _, v in items))

    def delete(self, key: ChunkKey) -> bool:
        if not self._backoff.available():
            return False
        try:
            with self._call():
                n = self._client.unlink(self._k(key))
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("delete", e)
            return False
        self._backoff.succeeded()
        return bool(n)

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        """One UNLINK of every key; the count removed (0 if the server is unavailable)."""
        names = [self._k(k) for k in keys]
        if not names or not self._backoff.available():
            return 0
        try:
            with self._call():
                n = self._client.unlink(*names)
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("delete", e)
            return 0
        self._backoff.succeeded()
        return int(n)

    def expiry(self, key: ChunkKey) -> float | None:
        return self.expiries([key])[0]

    def expiries(self, keys: Iterable[ChunkKey]) -> list[float | None]:
        """One pipeline of PTTL: ``clock() + pttl / 1000`` for keys with a TTL, None for keys
        without one, missing keys, and while the server is unavailable."""
        keys = list(keys)
        if not keys or not self._backoff.available():
            return [None] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.pttl(self._k(k))
            with self._call():
                ttls = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("pttl", e)
            return [None] * len(keys)
        self._backoff.succeeded()
        now = self.clock()
        return [now + ms / 1000 if ms is not None and ms >= 0 else None for ms in ttls]

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        return self.extend_many([key], expires_at)[0]

    def extend_many(self, keys: Iterable[ChunkKey], expires_at: float) -> list[bool]:
        """One pipeline of EXISTS + ``PEXPIRE key ms GT`` per key; True where the key is held."""
        keys = list(keys)
        if not keys or not self._backoff.available():
            return [False] * len(keys)
        ms = self._ms_left(expires_at)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
                if ms > 0:
                    pipe.pexpire(self._k(k), ms, gt=True)
            with self._call():
                replies = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("extend", e)
            return [False] * len(keys)
        self._backoff.succeeded()
        return [bool(n) for n in replies[:: 2 if ms > 0 else 1]]

    def expire(self) -> int:
        return 0  # Redis expires keys by itself

    def _scan(self, pattern: str):
        """The keys SCAN finds for ``pattern``, each SCAN round trip one bounded call (a cluster's
        SCAN goes node by node in redis-py's ``scan_iter``, each read bounded by the time-out)."""
        if self.cluster:
            yield from self._client.scan_iter(match=pattern, count=1000)
            return
        cursor = 0
        while True:
            with self._call():
                cursor, names = self._client.scan(cursor, match=pattern, count=1000)
            yield from names
            if int(cursor) == 0:
                return

    def delete_prefix(self, prefix: str) -> int:
        """SCAN for ``key_prefix + prefix*`` and UNLINK in batches; 0 if the server is unavailable.
        Redis has no index by prefix: SCAN walks the keyspace (the server filters by the pattern,
        1000 a call), so a delete costs in proportion to the whole database; it runs on the
        server's maintenance threads, bounded in number and in waiting (``server/maintenance.py``)."""
        if not self._backoff.available():
            return 0
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self.key_prefix + prefix) + "*"
        removed, batch = 0, []
        try:
            for k in self._scan(pattern):
                batch.append(k)
                if len(batch) >= 1000:
                    with self._call():
                        removed += self._client.unlink(*batch)
                    batch = []
            if batch:
                with self._call():
                    removed += self._client.unlink(*batch)
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("delete_prefix", e)
            return removed
        self._backoff.succeeded()
        return removed

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        """Up to ``limit`` stored keys (SCAN order; [] if the server is unavailable)."""
        if not self._backoff.available():
            return []
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self.key_prefix) + "*"
        out: list[ChunkKey] = []
        try:
            for k in self._scan(pattern):
                name = k.decode("utf-8", "replace") if isinstance(k, bytes) else k
                try:
                    out.append(ChunkKey.parse(name[len(self.key_prefix) :]))
                except ValueError:
                    continue  # not one of ours
                if limit is not None and len(out) >= limit:
                    break
        except (redis.RedisError, OSError) as e:
            self._backoff.failed("keys", e)
            return out
        self._backoff.succeeded()
        return out

    def ping(self) -> bool:
        """True if the server answers now (ignores and does not start a back-off)."""
        try:
            with self._call():
                return bool(self._client.ping())
        except (redis.RedisError, OSError):
            return False

    def close(self) -> None:
        try:
            self._client.close()
        except (redis.RedisError, OSError):
            pass
