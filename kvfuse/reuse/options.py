"""What a request asks of the cache (``CacheOptions``): the server maps API keys, ``cache_salt``,
``prompt_cache_key``, retention and breakpoints onto it; the CLI and benchmarks set it directly."""

from __future__ import annotations

from dataclasses import dataclass

from kvfuse.history.records import Record

from .retention import Breakpoint, Retention


@dataclass(frozen=True)
class CacheOptions:
    """Per-request cache behaviour: the server maps an API key's tenant onto ``tenant`` and the
    request's ``cache_salt`` onto ``salt``; tenants never share entries."""

    enabled: bool = True
    tenant: str = ""
    salt: str = ""
    store_generated: bool | None = None  # None -> the engine's default
    # OpenAI's prompt_cache_key: names a conversation's stored history
    history_key: str | None = None
    kv_slo_ms: float | None = None  # budget for loading KV from slow tiers (None: the engine's)
    # how long the entries it writes stay (None: the tiers' policy)
    retention: Retention | None = None
    # prompt prefixes to store even mid-chunk (kept >= their ttl)
    breakpoints: tuple[Breakpoint, ...] = ()
    # A stored history to line the prompt up with first (e.g. the one a Responses API
    # previous_response_id names); used only when its scope is the request's cache namespace.
    history_hint: Record | None = None
    # look for cached passages inside a plain prompt (None: blend.auto)
    auto_reuse: bool | None = None
    # the end user (OpenAI's ``user``): its histories are lined up only with its own requests
    user: str | None = None
