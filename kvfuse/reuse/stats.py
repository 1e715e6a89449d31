"""The cache engine's counters: what requests reused, recomputed and stored, from which tiers
(read by ``/metrics`` and ``/v1/kv/stats`` through ``Engine.stats_snapshot``, next to the serving
loop's own counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfuse.counters import Counters


@dataclass
class ReuseStats(Counters):
    """Monotonic counters of the reuse of finished requests."""

    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_recomputed: int = 0  # document tokens a blend recomputed in context
    blended_requests: int = 0
    # requests with documents by "method:budget:source"
    blends: dict[str, int] = field(default_factory=dict)
    # Automatic reuse: requests by status (off, skipped, prefix, none_found, blended), content
    # chunks looked up and found / missing, tokens reused from found spans.
    auto_requests: dict[str, int] = field(default_factory=dict)
    span_hits: int = 0
    span_misses: int = 0
    span_tokens_reused: int = 0
    chunks_stored: int = 0
    chunk_load_failures: int = 0  # entries found by lookup but unusable when fetched
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    history_requests: int = 0  # prompts lined up with a stored history (a record of its ids)
    history_tokens_reused: int = 0  # prompt tokens whose KV came from a stored history's entries
    moved_tokens_reused: int = 0  # of those, tokens reused at new positions (after dropped turns)
    streamed_requests: int = 0  # prompts whose slow-tier chunks were loaded within kv_slo_ms
    stream_slo_violations: int = 0  # of those, loads that took longer than the budget
    # chunks per encoding, or "recompute"
    stream_chunks: dict[str, int] = field(default_factory=dict)
    stream_bytes: int = 0
    # Loads run off the engine's step (``loader``): prompts whose KV was read while other
    # sequences kept decoding, and the time they spent there.
    offstep_loads: int = 0
    offstep_load_s: float = 0.0
