"""What a response may say about reuse: ``cached_tokens`` at chunk granularity unless the request
names its conversation.

The count of reused prompt tokens is exact to the token within a cache namespace: with no API
keys (every client one tenant) or many end users behind one key, a client could learn another
user's stored conversation one token per request, by guessing its next token and reading
``cached_tokens``. So, unless the request names the conversation it continues
(``prompt_cache_key``, ``previous_response_id``, ``user``: then it is lined up only with what it
named, or within that user's histories), every reuse figure it receives is rounded down to whole
chunks (``cache.chunk_size``): what a prefix cache reveals anyway (OpenAI reports cached tokens
in steps of 128). ``server.cached_tokens: exact`` turns this off (a single-user deployment,
benchmarks). The server's metrics keep the exact figures.
"""

from __future__ import annotations

from dataclasses import replace

from kvfuse.engine import GenerationResult, Outcome

MODES = ("chunk", "exact")


def names_conversation(body) -> bool:
    """Whether a request body names the conversation it continues."""
    return any(getattr(body, f, None) for f in ("prompt_cache_key", "previous_response_id", "user"))


def coarse(result: GenerationResult, chunk: int) -> GenerationResult:
    """``result`` with its reuse figures rounded down to whole chunks of ``chunk`` tokens: the
    cached tokens, their split (positioned first), the entries hit and the tokens written (a
    reused partial chunk is one fewer written)."""
    cached = result.cached_tokens // chunk * chunk
    prefix = min(result.prefix_reused_tokens, cached)
    return replace(
        result,
        cached_tokens=cached,
        prefix_reused_tokens=prefix,
        span_reused_tokens=min(result.span_reused_tokens, cached - prefix),
        hit_tiers=result.hit_tiers[: cached // chunk],
        written_tokens=result.written_tokens // chunk * chunk,
    )


def reported(outcome: Outcome, exact: bool, chunk: int) -> Outcome:
    """The outcome as the client receives it (see the module docstring)."""
    if exact or outcome.result is None:
        return outcome
    return replace(outcome, result=coarse(outcome.result, chunk))


def exact_for(body, mode: str) -> bool:
    """Whether ``body``'s response reports reuse exactly under ``server.cached_tokens``."""
    return mode == "exact" or names_conversation(body)
