"""The Redis / Valkey tier: pipelined batches, bounded waits, back-off while the server is away.

Every call is bounded (no client-side retries): connecting takes at most ``timeout_s``, and the
exchange that follows (sending the commands, reading every reply) at most ``timeout_s`` plus the
time its bytes take at ``min_rate`` bytes per second. A socket time-out alone bounds each read,
not a reply: a server (or link) that trickles a multi-MB value a few bytes per time-out would hold
a request for minutes. So the tier's sockets end every read and write at the calling thread's
deadline for the current call (``_DeadlineSocket``), and the deadline moves on with the bytes
moved: a slow but working link still serves big batches, a link slower than ``min_rate`` is a
time-out. A failure (refused, reset, timed out) is logged once, counted, answered as a miss
(writes are dropped and counted), and starts a back-off of ``backoff_s`` during which calls return
misses at once without touching the network. The first call after the back-off tries the server
again; redis-py reconnects by itself, so the tier recovers when the server comes back.

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

import logging
import math
import re
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterable

import redis
from redis.backoff import NoBackoff
from redis.connection import (Connection, Encoder, PythonRespSerializer, SSLConnection, UnixDomainSocketConnection,
                              parse_url)
from redis.retry import Retry

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Entry, Tier, check_key, nbytes

log = logging.getLogger(__name__)

_BUFFER_CUTOFF = 6000  # redis-py's default: values above it are sent without being copied

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")

MIN_RATE = 8_000_000  # bytes/s: a call moving its bytes slower than this times out (see the docstring)


class _Deadline(threading.local):
    """The calling thread's current call: when it started, its allowance, the bytes moved so far
    (None outside a call: the socket's own time-out applies alone)."""

    start: float | None = None
    budget_s = 0.0
    rate = float(MIN_RATE)
    moved = 0

    def left(self, extra_bytes: int = 0) -> float | None:
        """Seconds left before the call's deadline (None outside a call)."""
        if self.start is None:
            return None
        return self.start + self.budget_s + (self.moved + extra_bytes) / self.rate - time.monotonic()


_deadline = _Deadline()


class _DeadlineSocket:
    """A connected socket whose blocking reads and writes end at the calling thread's deadline
    (``_deadline``): each one runs with the smaller of the socket's time-out and the time left,
    and raises ``socket.timeout`` (which redis-py turns into its TimeoutError and a disconnect)
    once none is left. Everything else is the socket's own."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _bound(self, extra_bytes: int = 0) -> None:
        left = _deadline.left(extra_bytes)
        if left is None or self._timeout == 0:  # outside a call, or a non-blocking probe
            self._sock.settimeout(self._timeout)
            return
        if left <= 0:
            raise socket.timeout("the Redis call ran past its deadline")
        self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if flags & socket.MSG_PEEK:
            return self._sock.recv(bufsize, flags)  # a look, not a read (redis-py's closed-socket check)
        self._bound()
        data = self._sock.recv(bufsize, flags)
        _deadline.moved += len(data)
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        self._bound()
        n = self._sock.recv_into(buffer, nbytes, flags)
        _deadline.moved += n
        return n

    def sendall(self, data, flags: int = 0) -> None:
        size = memoryview(data).nbytes
        self._bound(size)  # the allowance includes these bytes (sendall's time-out covers it whole)
        self._sock.sendall(data, flags)
        _deadline.moved += size

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def pack_command(args: tuple, encode) -> list[bytes | memoryview]:
    """The RESP form of the command ``args`` as buffers to send in order, with every ``Entry``
    argument sent as its two buffers (header, then payload: one bulk string) rather than joined
    into a new one; other arguments are encoded by ``encode`` (redis-py's ``Encoder.encode``).
    Sent back to back, the buffers are exactly the bytes redis-py sends for the joined entry."""
    if isinstance(args[0], str):  # redis-py's rule: a command name may hold words ("CONFIG GET")
        args = tuple(args[0].encode().split()) + args[1:]
    out: list[bytes | memoryview] = []
    small = [b"*%d\r\n" % len(args)]  # short pieces, sent joined (one send instead of several)
    for arg in args:
        if isinstance(arg, Entry):
            header, payload = (memoryview(p).cast("B") for p in arg.parts())
            small.append(b"$%d\r\n" % (header.nbytes + payload.nbytes))
            out += [b"".join(small), header, payload]
            small = [b"\r\n"]
            continue
        data = encode(arg)
        small.append(b"$%d\r\n" % len(data))
        if len(data) > _BUFFER_CUTOFF or isinstance(data, memoryview):  # as redis-py: never copied
            out += [b"".join(small), data]
            small = [b"\r\n"]
        else:
            small += [data, b"\r\n"]
    out.append(b"".join(small))
    return out


class _EntryPacker:
    """A connection's command packer that sends an ``Entry`` value without joining its header and
    payload into a new buffer (``pack_command``): in a one-off A/B here, that join was ~15 ms of
    a ~90 ms put of 94 MB, a sixth of the time. Commands without an ``Entry`` go to the connection's own packer."""

    def __init__(self, inner, encode) -> None:
        self._inner, self._encode = inner, encode

    def pack(self, *args):
        if any(isinstance(a, Entry) for a in args):
            return pack_command(args, self._encode)
        return self._inner.pack(*args)


class _TierConnectionMixin:
    """What the tier's connections add to redis-py's: bounded calls (``_DeadlineSocket``) and
    ``Entry`` values sent as they are (``_EntryPacker``), for single servers and cluster nodes alike."""

    def _connect(self):
        return _DeadlineSocket(super()._connect())

    def _construct_command_packer(self, packer):
        return _EntryPacker(super()._construct_command_packer(packer), self.encoder.encode)


class _DeadlineConnection(_TierConnectionMixin, Connection):
    pass


class _DeadlineSSLConnection(_TierConnectionMixin, SSLConnection):
    pass


class _DeadlineUnixConnection(_TierConnectionMixin, UnixDomainSocketConnection):
    pass


_DEADLINE_CLASSES = {Connection: _DeadlineConnection, SSLConnection: _DeadlineSSLConnection,
                     UnixDomainSocketConnection: _DeadlineUnixConnection}


class _LazyCluster:
    """A ``RedisCluster`` client made at first use: the cluster client reads the slot map when it is
    made, so a cluster that is down at start-up would otherwise stop the server from starting. A
    failure to make it is a ``redis.ConnectionError`` (a tier failure like any other), retried at
    the next call after the back-off."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._url, self._timeout_s, self._real = url, timeout_s, None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._real is None:
                from redis.cluster import RedisCluster

                try:
                    # no retries: a timed-out call is not repeated (bounded waits); after a MOVED
                    # reply the client re-reads the slot map and the next call goes to the right node
                    client = RedisCluster.from_url(
                        self._url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s,
                        retry=Retry(NoBackoff(), 0),
                        connection_class=_DeadlineConnection)  # bounded calls (a rediss:// URL keeps its TLS class)
                except redis.RedisError:
                    raise
                except Exception as e:  # RedisClusterException is not a RedisError
                    raise redis.ConnectionError(f"cannot reach the Redis cluster at {self._url}: {e}") from None
                client.mget = client.mget_nonatomic  # one MGET per slot, replies in key order
                self._real = client
            return self._real

    def __getattr__(self, name: str):
        return getattr(self._get(), name)

    def close(self) -> None:
        if self._real is not None:
            self._real.close()


class RedisTier(Tier):
    """Entries as Redis strings under ``key_prefix + key``; optional TTL (``ttl_s``, None = none).

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://`` for TLS, ``unix://``); with
    ``cluster``, the URL of any node of a Redis Cluster (database 0). ``min_rate``: the slowest
    transfer, in bytes per second, a call waits for beyond ``timeout_s`` (see the module docstring).
    """

    batch_reads = True  # MGET: one round trip for a batch

    def __init__(
        self,
        url: str,
        timeout_s: float = 0.5,
        key_prefix: str = "kvfuse:",
        ttl_s: float | None = None,
        backoff_s: float = 1.0,
        name: str = "redis",
        cluster: bool = False,
        min_rate: float = MIN_RATE,
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
            if cluster:
                self._client = _LazyCluster(url, timeout_s)
            else:
                scheme_class = parse_url(url).get("connection_class", Connection)
                self._client = redis.Redis.from_url(
                    url,
                    connection_class=_DEADLINE_CLASSES.get(scheme_class, scheme_class),  # bounded calls
                    socket_timeout=timeout_s,
                    socket_connect_timeout=timeout_s,
                    retry=Retry(NoBackoff(), 0),  # a retry would double the worst-case wait
                    retry_on_timeout=False,
                    health_check_interval=0,
                    # Replies are parsed by hiredis when it is installed (a multi-MB value through the
                    # pure-Python parser costs more than the network here), but commands are always
                    # packed in Python: it sends large values as their own buffers, hiredis's packer
                    # copies them into the command first.
                    command_packer=PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode),
                )
        except ValueError as e:
            raise ValueError(f"bad Redis URL {url!r}: {e} (expected e.g. redis://127.0.0.1:6379/0)") from None
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    # -- failure handling -----------------------------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, error: Exception) -> None:
        with self._lock:
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.backoff_s
        if first:
            log.warning("redis tier %s: %s failed (%s); backing off %.1fs", self.url, op, error, self.backoff_s)
        self.stats.add(errors=1)

    def _succeeded(self) -> None:
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down:
                log.info("redis tier %s: server reachable again", self.url)

    def is_backing_off(self) -> bool:
        """True while calls are answered as misses without trying the server."""
        return not self._available()

    def _k(self, key: ChunkKey) -> str:
        return self.key_prefix + str(check_key(key))

    @contextmanager
    def _call(self):
        """One bounded exchange with the server (see the module docstring)."""
        _deadline.start, _deadline.budget_s, _deadline.rate, _deadline.moved = \
            time.monotonic(), self.timeout_s, self.min_rate, 0
        try:
            yield
        finally:
            _deadline.start = None

    # -- the Tier interface ---------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        keys = list(keys)
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            with self._call():
                found = [bool(n) for n in pipe.execute()]
        except (redis.RedisError, OSError) as e:
            self._failed("contains", e)
            return [False] * len(keys)
        self._succeeded()
        return found

    def get(self, key: ChunkKey) -> Blob | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        keys = list(keys)
        if not keys:
            return []
        if not self._available():
            self.stats.add(misses=len(keys))
            return [None] * len(keys)
        try:
            with self._call():
                values = self._client.mget([self._k(k) for k in keys])
        except (redis.RedisError, OSError) as e:
            self._failed("get", e)
            self.stats.add(misses=len(keys))
            return [None] * len(keys)
        self._succeeded()
        hits = [v for v in values if v is not None]
        self.stats.add(hits=len(hits), misses=len(keys) - len(hits), bytes_out=sum(map(len, hits)))
        return values

    def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | None:
        """GETRANGE: only the asked bytes cross the network (None on a miss or a failure)."""
        if stop <= start:
            return b""
        if not self._available():
            self.stats.add(misses=1)
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(self._k(key))
            pipe.getrange(self._k(key), start, stop - 1)
            with self._call():
                exists, value = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("getrange", e)
            self.stats.add(misses=1)
            return None
        self._succeeded()
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

    def put_many(self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None) -> None:
        items = list(items)
        if not items:
            return
        px = self.ttl_ms if expires_at is None else self._ms_left(expires_at)
        if px is not None and px <= 0:  # expired already: nothing is stored, no older value stays
            self.delete_many(k for k, _ in items)
            return
        if not self._available():
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
            self._failed("put", e)
            self.stats.add(dropped_writes=len(items))
            return
        self._succeeded()
        self.stats.add(puts=len(items), bytes_in=sum(nbytes(v) for _, v in items))

    def delete(self, key: ChunkKey) -> bool:
        if not self._available():
            return False
        try:
            with self._call():
                n = self._client.unlink(self._k(key))
        except (redis.RedisError, OSError) as e:
            self._failed("delete", e)
            return False
        self._succeeded()
        return bool(n)

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        """One UNLINK of every key; the count removed (0 if the server is unavailable)."""
        names = [self._k(k) for k in keys]
        if not names or not self._available():
            return 0
        try:
            with self._call():
                n = self._client.unlink(*names)
        except (redis.RedisError, OSError) as e:
            self._failed("delete", e)
            return 0
        self._succeeded()
        return int(n)

    def expiry(self, key: ChunkKey) -> float | None:
        return self.expiries([key])[0]

    def expiries(self, keys: Iterable[ChunkKey]) -> list[float | None]:
        """One pipeline of PTTL: ``clock() + pttl / 1000`` for keys with a TTL, None for keys
        without one, missing keys, and while the server is unavailable."""
        keys = list(keys)
        if not keys or not self._available():
            return [None] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.pttl(self._k(k))
            with self._call():
                ttls = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("pttl", e)
            return [None] * len(keys)
        self._succeeded()
        now = self.clock()
        return [now + ms / 1000 if ms is not None and ms >= 0 else None for ms in ttls]

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        return self.extend_many([key], expires_at)[0]

    def extend_many(self, keys: Iterable[ChunkKey], expires_at: float) -> list[bool]:
        """One pipeline of EXISTS + ``PEXPIRE key ms GT`` per key; True where the key is held."""
        keys = list(keys)
        if not keys or not self._available():
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
            self._failed("extend", e)
            return [False] * len(keys)
        self._succeeded()
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
        """SCAN for ``key_prefix + prefix*`` and UNLINK in batches; 0 if the server is unavailable."""
        if not self._available():
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
            self._failed("delete_prefix", e)
            return removed
        self._succeeded()
        return removed

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        """Up to ``limit`` stored keys (SCAN order; [] if the server is unavailable)."""
        if not self._available():
            return []
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self.key_prefix) + "*"
        out: list[ChunkKey] = []
        try:
            for k in self._scan(pattern):
                name = k.decode("utf-8", "replace") if isinstance(k, bytes) else k
                try:
                    out.append(ChunkKey.parse(name[len(self.key_prefix):]))
                except ValueError:
                    continue  # not one of ours
                if limit is not None and len(out) >= limit:
                    break
        except (redis.RedisError, OSError) as e:
            self._failed("keys", e)
            return out
        self._succeeded()
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
