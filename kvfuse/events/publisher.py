"""The KV event publisher: a thread of its own between kvfuse's notifications and a ZMQ socket.

Everything the request path (and the tiers, under their locks) does for events is ``offer`` an
item to the ``Inbox``: a deque append, never blocking, never waiting for the socket. When the
inbox holds ``capacity`` items the new ones are dropped and counted (``queue_drops``). The thread
takes what arrived, turns it into events (``Tracker``), and sends them as one batch, the way
vLLM's ``ZmqEventPublisher`` does:

- the live stream: an XPUB socket bound at ``server.kv_events``; each message is three frames,
  ``[topic, 8-byte big-endian sequence number, msgpack KVEventBatch]``, sequence numbers from 0
  with no gaps. ``XPUB_NODROP`` makes a subscriber over its high-water mark (a slow consumer)
  refuse the send instead of dropping silently: that batch is counted (``send_drops``) and kept
  for replay like any other, so a consumer that sees the gap can ask for it;
- the replay socket (``server.kv_events_replay``, optional): a ROUTER answering
  ``[identity, b"", start sequence (8 bytes)]`` with every kept batch from ``start`` on, each as
  ``[identity, b"", topic, sequence, payload]``, then ``[identity, b"", b"", -1, b""]`` (vLLM's
  protocol; the last ``server.kv_events_buffer`` batches are kept).

Unlike vLLM, kvfuse binds the endpoint it is given whatever its host (vLLM connects unless the
host is ``*``): a kvfuse server is the publisher routers dial (docs/api.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvfuse.counters import Counters

from .tracker import Tracker
from .wire import END_SEQ, Event, encode_batch, seq_bytes

log = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1024  # events per published batch at most (a large clear is split)
HWM = 100_000  # messages a subscriber may fall behind before sends to it are refused (vLLM's)


@dataclass
class PublisherStats(Counters):
    """``batches``/``events``: sent; ``send_drops``: batches a slow subscriber refused (kept for
    replay); ``queue_drops``: notifications dropped at the full inbox; ``replays``: replay
    requests served; ``errors``: notifications that raised (logged, skipped)."""

    batches: int = 0
    events: int = 0
    send_drops: int = 0
    queue_drops: int = 0
    replays: int = 0
    errors: int = 0
    subscribers: int = 0


class Inbox:
    """The bounded hand-off to the publisher thread; ``offer`` never blocks (see the module
    docstring). A deque's append and popleft are atomic, so producers take no lock."""

    def __init__(self, capacity: int, stats: PublisherStats) -> None:
        self.capacity = capacity
        self._items: deque = deque()
        self._wake = threading.Event()
        self._stats = stats

    def offer(self, item: tuple) -> bool:
        if len(self._items) >= self.capacity:
            self._stats.add(queue_drops=1)
            return False
        self._items.append(item)
        if not self._wake.is_set():
            self._wake.set()
        return True

    def wait(self, timeout: float) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def take(self) -> list[tuple]:
        out, items = [], self._items
        while items:
            out.append(items.popleft())
        return out

    def __len__(self) -> int:
        return len(self._items)


class Publisher:
    """The thread, its sockets and the tracker it feeds (see the module docstring). The sockets
    are made and bound here, so that a taken port is an error at start-up; after that only the
    thread touches them."""

    def __init__(
        self,
        tracker: Tracker,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        queue_size: int = 10_000,
        hwm: int = HWM,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.tracker = tracker
        self.topic = topic.encode("utf-8")
        self.stats = PublisherStats()
        self.inbox = Inbox(queue_size, self.stats)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"cannot bind the KV event socket {endpoint!r}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvfuse-kv-events", daemon=True)
        self._thread.start()

    # -- the thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self.inbox.wait(0.05)
            self._serve_sockets()
            items = self.inbox.take()
            if items:
                self._publish(self._events(items))
            elif self._stopping:
                return

    def _events(self, items: list[tuple]) -> list[Event]:
        """The events of the notifications ``items``, in order; one that raises is skipped."""
        t = self.tracker
        handlers = {
            "describe": t.describe,
            "found": t.found,
            "stored": t.stored,
            "removed": t.removed,
            "freed": t.freed,
            "cleared": t.cleared,
        }
        events: list[Event] = []
        for kind, *args in items:
            try:
                events += handlers[kind](*args)
            except Exception:
                log.exception("KV events: a %s notification failed; skipped", kind)
                self.stats.add(errors=1)
        return events

    def _publish(self, events: list[Event]) -> None:
        for i in range(0, len(events), MAX_BATCH_EVENTS):
            part = events[i : i + MAX_BATCH_EVENTS]
            payload = encode_batch(time.time(), part)
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart(
                    (self.topic, seq_bytes(seq), payload), flags=self._zmq.NOBLOCK
                )
                self.stats.add(batches=1, events=len(part))
            except self._zmq.Again:
                self.stats.add(send_drops=1)

    def _serve_sockets(self) -> None:
        """Read the subscribers' (un)subscriptions and answer replay requests (both cheap polls)."""
        zmq = self._zmq
        while self._pub.poll(0):
            frame = self._pub.recv(zmq.NOBLOCK)
            if frame[:1] in (b"\x01", b"\x00"):
                self.stats.add(subscribers=1 if frame[:1] == b"\x01" else -1)
        while self._replay is not None and self._replay.poll(0):
            self._answer_replay(self._replay.recv_multipart(zmq.NOBLOCK))

    def _answer_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
        self.stats.add(replays=1)  # before the end frame: counted once the client has it all
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # -- the other threads' side ----------------------------------------------------------------

    def offer(self, item: tuple) -> bool:
        """Hand a notification to the thread (never blocks; False when it was dropped)."""
        return self.inbox.offer(item)

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        self._stopping = True
        self.inbox.wake()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()
