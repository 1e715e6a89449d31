"""Per-tenant request rates: ``tenants.<name>.quota.requests_per_minute`` (``kvfuse.config.tenants``).

A sliding window, exact: a tenant's request, on any authenticated route (generation, and since
issue 39 item 7 the models, KV statistics and deletes, stored responses and token counting too: a
route left out is one a tenant can send without limit), is admitted when fewer than ``limit`` of
its admitted requests started in the last 60 seconds;
otherwise it is a 429 whose body is OpenAI's rate-limit error (``type: "requests"``, ``code:
"rate_limit_exceeded"``, the message naming the limit and the setting) with ``Retry-After`` (whole
seconds until the oldest counted request leaves the window) and OpenAI's ``x-ratelimit-*-requests``
headers. Refused requests are not counted (a client that retries after ``Retry-After`` gets in). A
token bucket would let a tenant send twice its limit within one minute (a full bucket, then its
refill); a window of the admitted requests' times costs at most ``limit`` floats per tenant.

``decide`` is the rule, pure; ``RateLimiter`` keeps each tenant's times and applies it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import APIError

WINDOW_S = 60.0


@dataclass(frozen=True)
class Decision:
    """The rule's answer for one request: ``allowed``; ``used``, the tenant's requests in the window
    before this one; ``expired``, how many of the oldest times left the window (to forget); and
    ``retry_after_s``, when a refused request would be admitted (0 when allowed)."""

    allowed: bool
    used: int
    expired: int
    retry_after_s: float


def decide(times: Sequence[float], now: float, limit: int, window_s: float = WINDOW_S) -> Decision:
    """Admit a request at ``now`` given the admitted ones' ``times`` (ascending), at most ``limit``
    per ``window_s``. A time exactly ``window_s`` old has left the window."""
    cutoff = now - window_s
    expired = 0
    while expired < len(times) and times[expired] <= cutoff:
        expired += 1
    used = len(times) - expired
    if used < limit:
        return Decision(True, used, expired, 0.0)
    # room comes when the oldest request beyond limit - 1 leaves the window
    oldest = times[expired + used - limit]
    return Decision(False, used, expired, oldest + window_s - now)


class RateLimiter:
    """Each tenant's admitted requests' times; ``limit_of(tenant)``: its requests per minute (None:
    unlimited). ``clock``: monotonic seconds (tests inject one). Thread-safe."""

    def __init__(
        self, limit_of: Callable[[str], int | None], clock: Callable[[], float] = time.monotonic
    ):
        self._limit_of = limit_of
        self._clock = clock
        self._times: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: str) -> tuple[Decision, int] | None:
        """Count a request of ``tenant`` if its limit allows: (the decision, the limit); None when the
        tenant has no limit."""
        limit = self._limit_of(tenant)
        if limit is None:
            return None
        with self._lock:
            times = self._times.setdefault(tenant, deque())
            now = self._clock()
            d = decide(times, now, limit)
            for _ in range(d.expired):
                times.popleft()
            if d.allowed:
                times.append(now)
        return d, limit


def rate_limited(tenant: str, setting: str, decision: Decision, limit: int) -> APIError:
    """The 429 for a refused request, shaped as OpenAI's (``type: requests``, ``code:
    rate_limit_exceeded``), naming the limit and the ``setting`` that sets it."""
    wait = decision.retry_after_s
    who = f"tenant {tenant!r}" if tenant else "the anonymous tenant"
    message = (
        f"Rate limit reached for requests per minute (RPM) of {who}: Limit {limit}, Used {decision.used}, "
        f"Requested 1. Please try again in {wait:.3g}s. The limit is {setting}."
    )
    return APIError(
        429,
        message,
        type="requests",
        code="rate_limit_exceeded",
        headers={
            "retry-after": str(max(1, math.ceil(wait))),
            "x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": f"{wait:.3g}s",
        },
    )
