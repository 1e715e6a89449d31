"""Maintenance off the generation path: a small pool of its own, bounded in jobs and in waiting.

Why: ``DELETE /v1/kv`` waits for queued saves and walks every tier (the disk tier lists its
folders, Redis SCANs), ``/v1/kv/stats`` asks remote tiers, and the stored responses' routes read
SQLite and free entries. Run with ``asyncio.to_thread`` they shared the default executor with
generation's own blocking steps (rendering a prompt, ``Engine.submit``), and waited without bound:
one tenant sending many of them held every thread, and other tenants' requests queued behind.

Here they run on ``server.maintenance_workers`` threads of their own. A job is admitted only while
fewer than ``server.maintenance_queue`` jobs wait or run (503 beyond: the pool's bound) and fewer
than ``server.maintenance_per_tenant`` of its tenant's (429 beyond: one tenant cannot fill the
pool), both with ``Retry-After``. A request waits at most ``server.maintenance_timeout_s`` for its
job: then a 504 (code ``maintenance_timeout``) while the job runs to its end in the background,
still counted against both bounds until it does, so a flood never piles up threads or work.
Every maintenance job is idempotent (deletes, reads): a client may repeat one that timed out.

``refusal`` is the admission rule, pure; ``MaintenancePool`` keeps the counts and applies it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import APIError

T = TypeVar("T")

RETRY_AFTER_S = 1  # a refused job's Retry-After: maintenance jobs are short or time out


def refusal(running: int, of_tenant: int, queue: int, per_tenant: int) -> int | None:
    """Whether one more job may start given ``running`` jobs (``of_tenant`` of them the caller's):
    None when it may; 429 when the tenant already has ``per_tenant`` (its own doing, checked first
    so that a tenant flooding the pool is told so), 503 when the pool holds ``queue``."""
    if of_tenant >= per_tenant:
        return 429
    if running >= queue:
        return 503
    return None


class MaintenancePool:
    """The maintenance jobs' threads and bounds (see the module docstring). Thread-safe."""

    def __init__(self, workers: int, queue: int, per_tenant: int, timeout_s: float):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvfuse-maint")
        self.queue, self.per_tenant, self.timeout_s = queue, per_tenant, timeout_s
        self._lock = threading.Lock()
        self._running = 0
        self._by_tenant: Counter[str] = Counter()

    def load(self) -> dict[str, int]:
        """Jobs waiting or running, and the tenants that have some."""
        with self._lock:
            return {"jobs": self._running, "tenants": len(self._by_tenant)}

    async def run(self, tenant: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the pool for ``tenant``: its result, or the 429/503 of a refused job,
        the 504 of one not done within ``timeout_s``; what ``fn`` raises propagates."""
        self._enter(tenant)
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, self._job, tenant, fn, args
            )
        except BaseException:
            self._leave(tenant)
            raise
        # a job left behind by a time-out: its outcome is retrieved (never "never retrieved")
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                504,
                f"the maintenance request did not finish within {self.timeout_s:g}s "
                "(server.maintenance_timeout_s); it goes on in the background and may be repeated",
                code="maintenance_timeout",
            ) from None

    def _job(self, tenant: str, fn: Callable[..., T], args: tuple) -> T:
        try:
            return fn(*args)
        finally:
            self._leave(tenant)

    def _enter(self, tenant: str) -> None:
        with self._lock:
            status = refusal(self._running, self._by_tenant[tenant], self.queue, self.per_tenant)
            if status is None:
                self._running += 1
                self._by_tenant[tenant] += 1
                return
        if status == 429:
            who = f"tenant {tenant!r}" if tenant else "the anonymous tenant"
            message = (
                f"{who} already has {self.per_tenant} maintenance requests running "
                "(server.maintenance_per_tenant); retry when one is done"
            )
        else:
            message = (
                f"the server already runs {self.queue} maintenance requests "
                "(server.maintenance_queue); retry shortly"
            )
        raise APIError(
            status,
            message,
            code="rate_limit_exceeded" if status == 429 else "maintenance_busy",
            headers={"retry-after": str(RETRY_AFTER_S)},
        )

    def _leave(self, tenant: str) -> None:
        with self._lock:
            self._running -= 1
            self._by_tenant[tenant] -= 1
            if self._by_tenant[tenant] <= 0:
                del self._by_tenant[tenant]

    def close(self) -> None:
        """Stop taking jobs; the running ones finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
