"""Per-tenant requests per minute: the sliding-window rule (table), the limiter, the 429's shape."""

from __future__ import annotations

import pytest

from kvfuse.server.rate_limit import Decision, RateLimiter, decide, rate_limited


@pytest.mark.parametrize(
    "times, now, limit, expected",
    [
        ((), 0.0, 1, Decision(True, 0, 0, 0.0)),
        ((0.0,), 1.0, 1, Decision(False, 1, 0, 59.0)),
        ((0.0,), 60.0, 1, Decision(True, 0, 1, 0.0)),  # exactly a window old: out
        ((0.0, 10.0, 20.0), 30.0, 3, Decision(False, 3, 0, 30.0)),  # room when the oldest leaves
        ((0.0, 10.0, 20.0), 30.0, 4, Decision(True, 3, 0, 0.0)),
        (
            (0.0, 10.0, 20.0, 50.0),
            65.0,
            2,
            Decision(False, 3, 1, 15.0),
        ),  # 10 and 20 must leave: 20 + 60 - 65
        ((0.0, 10.0, 20.0, 50.0), 81.0, 2, Decision(True, 1, 3, 0.0)),
    ],
)
def test_decide(times, now, limit, expected):
    assert decide(times, now, limit) == expected


def test_the_limiter_counts_admitted_requests_per_tenant_only():
    now = [0.0]
    limiter = RateLimiter({"alice": 2, "bob": 1}.get, clock=lambda: now[0])
    assert limiter.admit("carol") is None  # no limit
    assert [limiter.admit("alice")[0].allowed for _ in range(4)] == [True, True, False, False]
    assert limiter.admit("bob")[0].allowed  # alice's requests are not bob's
    now[0] = 30.0
    refused, limit = limiter.admit("alice")
    # refusals are not counted
    assert not refused.allowed and limit == 2 and refused.retry_after_s == 30.0
    now[0] = 60.0  # both of t=0 have left the window
    assert [limiter.admit("alice")[0].allowed for _ in range(3)] == [True, True, False]


def test_the_429_is_openais_rate_limit_error_naming_the_setting():
    err = rate_limited(
        "alice", "tenants.alice.quota.requests_per_minute", Decision(False, 5, 0, 12.3), 5
    )
    assert err.status == 429
    body = err.body()["error"]
    assert (
        body["type"] == "requests"
        and body["code"] == "rate_limit_exceeded"
        and body["param"] is None
    )
    assert (
        "Limit 5, Used 5, Requested 1" in body["message"]
        and "try again in 12.3s" in body["message"]
    )
    assert "tenants.alice.quota.requests_per_minute" in body["message"]
    assert err.headers["retry-after"] == "13" and err.headers["x-ratelimit-limit-requests"] == "5"
    assert rate_limited("", "s", Decision(False, 1, 0, 0.2), 1).headers["retry-after"] == "1"
