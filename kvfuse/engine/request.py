"""What goes into the engine and what comes out: requests, their options, results and outcomes."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfuse.blend.options import BlendOptions
from kvfuse.generation import SamplingParams
from kvfuse.history.records import Record
from kvfuse.prompts.prompt import Prompt
from kvfuse.reuse import CacheOptions, KVStreamReport
from kvfuse.sampling.logprobs import TokenLogprob

log = logging.getLogger(__name__)

_ids = itertools.count(1)


@dataclass
class Timings:
    queued_s: float = 0.0
    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start (after queueing) -> first token sampled
    decode_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0

    def decode_tokens_per_s(self, completion_tokens: int) -> float:
        steps = completion_tokens - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class Choice:
    """One of a request's ``n`` choices: what it generated and why it stopped; ``logprobs``: one
    entry per generated token when they were asked for (``SamplingParams.logprobs``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Delta:
    """What one choice produced in one step, for streaming (``Request.on_delta``): its new text
    (may be empty, e.g. held back by a stop string) and the logprobs of the token accepted; or,
    once and before any token, the prompt's logprobs (``prompt_logprobs``, choice 0)."""

    index: int
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(kw_only=True)
class GenerationResult:
    """What a finished request produced, and how its prompt's KV was served."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    hit_tiers: tuple[str, ...] = ()  # the tier each reused entry came from
    stored_chunks: int = 0
    recomputed_tokens: int = 0  # document tokens recomputed in context by a blend
    kv_stream: KVStreamReport | None = None  # slow-tier chunks loaded adaptively within kv_slo_ms
    written_tokens: int = 0  # prompt tokens whose KV this request handed to the cache
    history: Record | None = None  # the stored history of the KV this turn kept (None: none kept)
    # how the prompt's documents (or found spans) were used (None: neither)
    blend: BlendOptions | None = None
    # of cached_tokens, those loaded at their own positions (prefix, history)
    prefix_reused_tokens: int = 0
    span_reused_tokens: int = 0  # of cached_tokens, those of documents and found spans (blended)
    auto_reuse: str = "off"  # automatic reuse: off | skipped | prefix | none_found | blended
    # Every choice, by index (``text``, ``token_ids`` and ``finish_reason`` above are choice 0's);
    # empty in a result that never ran.
    choices: list[Choice] = field(default_factory=list)
    # the prompt's logprobs when asked for (``SamplingParams.prompt_logprobs``): None for its
    # first token, then one entry per token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_sequence: str | None = None  # the stop string that ended the text (finish "stop")

    @classmethod
    def cancelled(cls, prompt_tokens: int) -> GenerationResult:
        """The result of a request that never ran (its client left, the engine stopped)."""
        return cls(text="", token_ids=[], finish_reason="cancelled", prompt_tokens=prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, over every choice (what OpenAI's usage counts)."""
        if self.choices:
            return sum(len(c.token_ids) for c in self.choices)
        return len(self.token_ids)


class QueueFull(Exception):
    """The queue already holds ``max_waiting`` requests."""


class QueueClosed(Exception):
    """The engine is shutting down and takes no more requests."""


class RequestCancelled(Exception):
    """The request never ran: its client left while it waited, or the engine shut down."""


@dataclass(frozen=True)
class Outcome:
    """How a request ended: a result, or the error that prevented one."""

    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    """One generation request as the engine takes it.

    ``on_text`` receives text pieces as they are decoded (choice 0's), ``on_delta`` every
    choice's pieces with their logprobs (``Delta``), and ``on_done`` the ``Outcome``, exactly
    once; ``on_start``, at most once, the result so far when the prompt is prefilled, before any
    text (what it reused and wrote: Anthropic's stream reports that usage first); all are called
    on the engine's thread. Setting ``cancel`` stops the request: a waiting
    one is skipped, a running one stops at its next step (finish reason "cancelled").
    """

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    cache: CacheOptions = field(default_factory=CacheOptions)
    blend: BlendOptions | None = None  # None: the engine's blend options (prompts with documents)
    # a request's recompute budget over ``blend`` (the server's ``recompute_ratio``; None: as is)
    recompute_ratio: float | str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_text: Callable[[str], None] | None = None
    on_delta: Callable[[Delta], None] | None = None
    on_done: Callable[[Outcome], None] | None = None
    on_start: Callable[[GenerationResult], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    _done: bool = field(default=False, repr=False)

    @property
    def tenant(self) -> str:
        return self.cache.tenant

    def finish(self, outcome: Outcome) -> None:
        if self._done:
            return
        self._done = True
        if self.on_done is not None:
            try:
                self.on_done(outcome)
            except Exception:  # e.g. the event loop is already closed at shutdown
                log.debug(
                    "request %s: could not deliver its outcome", self.request_id, exc_info=True
                )

    def started(self, result: GenerationResult) -> None:
        """The prompt is prefilled: ``on_start`` gets the result so far."""
        if self.on_start is None or self._done:
            return
        try:
            self.on_start(result)
        except Exception:  # e.g. the event loop is already closed at shutdown
            log.debug("request %s: could not deliver its start", self.request_id, exc_info=True)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def queue_wait_s(self) -> float:
        return (self.started_at or time.monotonic()) - self.enqueued_at
