"""The event-loop side of an engine request: text pieces and the outcome, delivered thread-safely.

The engine calls a request's ``on_text`` / ``on_done`` on its own thread; asyncio objects are not
thread-safe, so ``RequestEvents`` hands each item to the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio

from kvfuse.engine import Delta, Outcome


class RequestEvents:
    """An asyncio queue fed from the engine thread: text pieces (``str``, from ``on_text``) or
    per-choice deltas (``Delta``, from ``on_delta``) and, last, the ``Outcome``."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._items: asyncio.Queue[str | Delta | Outcome] = asyncio.Queue()

    def on_text(self, piece: str) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._items.put_nowait, piece)

    def on_delta(self, delta: Delta) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._items.put_nowait, delta)

    # engine thread (or the loop, for a withdrawn request)
    def on_done(self, outcome: Outcome) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, outcome)

    async def next(self) -> str | Delta | Outcome:
        return await self._items.get()

    async def outcome(self) -> Outcome:
        """Wait for the outcome, discarding any text pieces."""
        while not isinstance(item := await self._items.get(), Outcome):
            pass
        return item
