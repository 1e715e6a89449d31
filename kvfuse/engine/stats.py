"""The engine's counters (read by ``/metrics`` and ``/v1/kv/stats`` while the engine runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfuse.counters import Counters

# Histogram buckets of sequences / tokens per step (powers of two).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def bucket(n: int) -> str:
    """The smallest bucket >= n (the last one for anything larger), as a counter key."""
    return str(next((b for b in BUCKETS if n <= b), BUCKETS[-1]))


@dataclass
class EngineStats(Counters):
    """Monotonic counters of the requests the engine finished."""

    requests: int = 0
    requests_skipped: int = 0  # cancelled while they waited: never started
    prompt_tokens: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_generated: int = 0
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
    truncated_requests: int = 0  # conversations that outgrew the context window
    truncated_messages: int = 0  # messages dropped from them
    streamed_requests: int = 0  # prompts whose slow-tier chunks were loaded within kv_slo_ms
    stream_slo_violations: int = 0  # of those, loads that took longer than the budget
    # chunks per encoding, or "recompute"
    stream_chunks: dict[str, int] = field(default_factory=dict)
    stream_bytes: int = 0
    # Continuous batching: forward passes, the sequences and tokens in them, preemptions.
    steps: int = 0
    step_sequences: int = 0
    step_tokens: int = 0
    # steps per sequences-per-step bucket ("16": 9..16)
    batch_sizes: dict[str, int] = field(default_factory=dict)
    # steps per tokens-per-step bucket
    step_token_counts: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0  # running sequences whose KV was freed to make room (they ran again later)
