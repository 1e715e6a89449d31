"""Engines still open when the interpreter exits are closed first, as ``Engine.close`` does.

An engine's cache engine runs daemon threads (the saver's copies, the store's write-behind) that
spend most of their time in C++ with the GIL released. A program that uses the engine API and
returns without ``close()`` used to end in ``terminate called without an active exception``
(an abort, exit status 134) whenever such a thread was inside a copy at finalization: it woke up
to take the GIL back from an interpreter that no longer existed. The hook closes such engines
while the interpreter still runs, which flushes the queued saves (nothing a caller produced is
lost) and stops those threads while they still can stop.

It is registered with ``threading``'s exit hooks, as ``concurrent.futures`` registers its own,
not with ``atexit``: those run first, and in reverse order of registration, so ours runs before
``concurrent.futures`` refuses new work to its pools (the disk tier writes through one; from an
``atexit`` handler its writes failed with "cannot schedule new futures after interpreter
shutdown"). Where ``threading`` lacks that hook, ``atexit`` is the fallback.

Engines are held weakly: registering one keeps nothing alive, and one collected or closed
before exit is simply gone from the set.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first, so that ours runs before it)
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

#: How long the exit hook waits for one engine's queued saves before giving up on them.
FLUSH_AT_EXIT_S = 30.0


class Closable(Protocol):
    def close(self, flush_timeout: float | None = None) -> bool: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def register(engine: Closable) -> None:
    """Close ``engine`` at interpreter exit if it is still open then (``close`` is idempotent)."""
    _open.add(engine)


def unregister(engine: Closable) -> None:
    """``engine`` was closed: the exit hook has nothing left to do for it."""
    _open.discard(engine)


def close_all(flush_timeout: float | None = FLUSH_AT_EXIT_S) -> int:
    """Close every registered engine (the exit hook); how many were closed. A failure to close
    one is logged and does not stop the others."""
    engines = list(_open)
    for engine in engines:
        try:
            if not engine.close(flush_timeout):
                log.warning("exit: an engine's queued KV saves did not end in %s s", flush_timeout)
        except Exception:
            log.exception("exit: closing an engine failed")
    _open.clear()
    return len(engines)


def _install() -> None:
    hook = getattr(threading, "_register_atexit", None)
    if hook is None:
        atexit.register(close_all)
        return
    hook(close_all)


_install()
