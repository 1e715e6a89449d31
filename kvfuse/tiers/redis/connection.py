"""The Redis tier's connections: bounded calls, ``Entry`` values sent unjoined, a lazily made cluster client.

Every call is bounded (no client-side retries): connecting takes at most ``timeout_s``, and the
exchange that follows (sending the commands, reading every reply) at most ``timeout_s`` plus the
time its bytes take at ``min_rate`` bytes per second. A socket time-out alone bounds each read,
not a reply: a server (or link) that trickles a multi-MB value a few bytes per time-out would hold
a request for minutes. So the tier's sockets end every read and write at the calling thread's
deadline for the current call (``_DeadlineSocket``, armed by ``bounded_call``), and the deadline
moves on with the bytes moved: a slow but working link still serves big batches, a link slower
than ``min_rate`` is a time-out.

Commands are packed in Python (``PythonRespSerializer``), and an ``Entry`` value goes out as its
header and payload buffers rather than joined into a new one (``pack_command``).

A seam of its own because all of this is plumbing under redis-py (its connection classes, its
command packer, its cluster client), independent of what the tier stores: the tier asks for a
client (``make_client``) and wraps each exchange in ``bounded_call``.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import redis
from redis.backoff import NoBackoff
from redis.connection import (
    Connection,
    Encoder,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.retry import Retry

from kvfuse.config.secrets import redact_url
from kvfuse.tiers.base import Entry

_BUFFER_CUTOFF = 6000  # redis-py's default: values above it are sent without being copied

MIN_RATE = (
    8_000_000  # bytes/s: a call moving its bytes slower than this times out (see the docstring)
)


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
        return (
            self.start + self.budget_s + (self.moved + extra_bytes) / self.rate - time.monotonic()
        )


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
            return self._sock.recv(
                bufsize, flags
            )  # a look, not a read (redis-py's closed-socket check)
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


_DEADLINE_CLASSES = {
    Connection: _DeadlineConnection,
    SSLConnection: _DeadlineSSLConnection,
    UnixDomainSocketConnection: _DeadlineUnixConnection,
}


class _LazyCluster:
    """A ``RedisCluster`` client made at first use: the cluster client reads the slot map when it is
    made, so a cluster that is down at start-up would otherwise stop the server from starting. A
    failure to make it is a ``redis.ConnectionError`` (a tier failure like any other), retried at
    the next call after the back-off."""

    def __init__(self, url: str, timeout_s: float, security: dict) -> None:
        self._url, self._timeout_s, self._security, self._real = url, timeout_s, security, None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._real is None:
                from redis.cluster import RedisCluster

                try:
                    # no retries: a timed-out call is not repeated (bounded waits); after a MOVED
                    # reply the client re-reads the slot map and the next call goes to the right node
                    client = RedisCluster.from_url(
                        self._url,
                        socket_timeout=self._timeout_s,
                        socket_connect_timeout=self._timeout_s,
                        retry=Retry(NoBackoff(), 0),
                        connection_class=_DeadlineConnection,  # bounded calls (a rediss:// URL keeps its TLS class)
                        **self._security,
                    )
                except redis.RedisError:
                    raise
                except Exception as e:  # RedisClusterException is not a RedisError
                    raise redis.ConnectionError(
                        f"cannot reach the Redis cluster at {redact_url(self._url)}: {e}"
                    ) from None
                client.mget = client.mget_nonatomic  # one MGET per slot, replies in key order
                self._real = client
            return self._real

    def __getattr__(self, name: str):
        return getattr(self._get(), name)

    def close(self) -> None:
        if self._real is not None:
            self._real.close()


@dataclass(frozen=True)
class Security:
    """A Redis connection's ACL user and password and its TLS files (``rediss://`` URLs): the CA
    that signed the server's certificate (None: the system's CAs), and the client's certificate
    and key for a server that asks for one. The password is kept out of the repr."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def client_kwargs(self) -> dict:
        """redis-py's arguments for these settings (only those given: a plain connection takes no
        TLS arguments)."""
        out = {
            "username": self.username,
            "password": self.password,
            "ssl_ca_certs": self.tls_ca_file,
            "ssl_certfile": self.tls_cert_file,
            "ssl_keyfile": self.tls_key_file,
        }
        return {k: v for k, v in out.items() if v is not None}


def make_client(url: str, timeout_s: float, cluster: bool, security: Security = Security()):
    """A redis-py client for ``url`` whose calls are bounded (see the module docstring) and never
    retried: a ``redis.Redis``, or with ``cluster`` a ``_LazyCluster``. ``security``: the ACL user
    and TLS files. ValueError for a bad URL."""
    if cluster:
        return _LazyCluster(url, timeout_s, security.client_kwargs())
    scheme_class = parse_url(url).get("connection_class", Connection)
    return redis.Redis.from_url(
        url,
        **security.client_kwargs(),
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
        command_packer=PythonRespSerializer(
            _BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode
        ),
    )


@contextmanager
def bounded_call(timeout_s: float, min_rate: float) -> Iterator[None]:
    """One bounded exchange with the server on this thread: its reads and writes end once
    ``timeout_s`` plus the bytes moved at ``min_rate`` bytes/s have passed."""
    _deadline.start, _deadline.budget_s, _deadline.rate, _deadline.moved = (
        time.monotonic(),
        timeout_s,
        min_rate,
        0,
    )
    try:
        yield
    finally:
        _deadline.start = None
