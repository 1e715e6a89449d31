"""The maintenance pool (``kvfuse/server/maintenance.py``): its admission rule as a table, its
bounds and its time-out on real threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvfuse.server.errors import APIError
from kvfuse.server.maintenance import MaintenancePool, refusal


@pytest.mark.parametrize(
    "running,of_tenant,queue,per_tenant,expected",
    [
        (0, 0, 8, 2, None),
        (7, 1, 8, 2, None),  # room in the pool and in the tenant's share
        (1, 2, 8, 2, 429),  # the tenant's own share is full
        (8, 0, 8, 2, 503),  # the pool is full, the tenant has none running
        (8, 2, 8, 2, 429),  # both: the tenant is told it is its own doing
        (0, 0, 1, 1, None),
    ],
)
def test_refusal(running, of_tenant, queue, per_tenant, expected):
    assert refusal(running, of_tenant, queue, per_tenant) == expected


def test_bounds_time_out_and_release():
    """A tenant past its share gets 429, the pool past its queue 503 (both with Retry-After), a job
    past the time-out 504 while it keeps its slot until it ends; then the slots are free again."""
    pool = MaintenancePool(workers=2, queue=3, per_tenant=2, timeout_s=0.2)
    gate = threading.Event()

    async def scenario():
        blocked = [asyncio.ensure_future(pool.run(t, gate.wait, 5)) for t in ("a", "a", "b")]
        await asyncio.sleep(0.05)
        assert pool.load() == {"jobs": 3, "tenants": 2}
        with pytest.raises(APIError) as own:
            await pool.run("a", lambda: 1)
        with pytest.raises(APIError) as full:
            await pool.run("c", lambda: 1)
        results = await asyncio.gather(*blocked, return_exceptions=True)
        gate.set()
        return own.value, full.value, results

    own, full, results = asyncio.run(scenario())
    assert own.status == 429 and own.headers["retry-after"] == "1"
    assert full.status == 503 and full.code == "maintenance_busy"
    assert all(isinstance(r, APIError) and r.code == "maintenance_timeout" for r in results)
    # the timed-out jobs finish in the background and give their slots back
    deadline = threading.Event()
    for _ in range(50):
        if pool.load()["jobs"] == 0:
            break
        deadline.wait(0.02)
    assert pool.load() == {"jobs": 0, "tenants": 0}
    assert asyncio.run(pool.run("a", lambda x: x + 1, 41)) == 42
    pool.close()


def test_what_the_job_raises_reaches_the_caller_and_frees_the_slot():
    pool = MaintenancePool(workers=1, queue=1, per_tenant=1, timeout_s=1.0)

    def fails():
        raise KeyError("no such response")

    with pytest.raises(KeyError):
        asyncio.run(pool.run("a", fails))
    assert pool.load()["jobs"] == 0
    pool.close()
