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
    """Monotonic counters of the requests the serving loop finished and its batched steps
    (what they reused: ``reuse.ReuseStats``)."""

    requests: int = 0
    requests_skipped: int = 0  # cancelled while they waited: never started
    prompt_tokens: int = 0
    tokens_generated: int = 0
    # Continuous batching: forward passes, the sequences and tokens in them, preemptions.
    steps: int = 0
    step_sequences: int = 0
    step_tokens: int = 0
    # steps per sequences-per-step bucket ("16": 9..16)
    batch_sizes: dict[str, int] = field(default_factory=dict)
    # steps per tokens-per-step bucket
    step_token_counts: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0  # running sequences whose KV was freed to make room (they ran again later)
    # requests with n > 1: choices forked onto a copy of the prompt's KV, and those queued instead
    choices_forked: int = 0
    choices_queued: int = 0
