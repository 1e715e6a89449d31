"""One kvfuse store per configuration per process, shared by the connector's two roles.

vLLM builds a scheduler-side and a worker-side connector. When they share a process they share
this store too, so the scheduler's lookup sees the worker's memory tier. When they do not (vLLM's
multiprocess executor, the default on CPU too), each process has its own store; the scheduler's
memory tier then stays empty (it never saves), so its lookups only count what the disk and Redis
tiers hold, which the worker can read: it never promises a chunk that only another process's memory
holds.
"""

from __future__ import annotations

import threading

from kvfuse.config import Config
from kvfuse.store import TieredStore

_lock = threading.Lock()
_stores: dict[Config, list] = {}  # config -> [store, users]


def acquire_store(config: Config) -> TieredStore:
    """The process's store for ``config`` (opened on first use, with ``kvfuse.runtime.open_store``)."""
    from kvfuse.runtime import open_store

    with _lock:
        got = _stores.get(config)
        if got is None:
            store = open_store(config)
            if store is None:
                raise ValueError(
                    "the kvfuse cache is disabled in this configuration (cache.enabled: false)"
                )
            got = _stores[config] = [store, 0]
        got[1] += 1
        return got[0]


def release_store(store: TieredStore) -> None:
    """Give ``store`` back; the last user flushes its queued writes and closes it."""
    with _lock:
        for config, got in list(_stores.items()):
            if got[0] is store:
                got[1] -= 1
                if got[1] > 0:
                    return
                del _stores[config]
                break
        else:
            return
    store.close()
