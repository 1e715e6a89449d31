"""A request's state inside the serving loop, from queued to finished, in typed parts.

``WAITING`` (in the queue, keyed) -> ``RUNNING`` (admitted: its KV memory taken; first
``loading`` while the cache engine plans and loads its prompt off the step, then its prompt
computed in chunks, one chunk per step (``PrefillState.fill``), then one token per step) ->
``FINISHED``.

- ``reuse``: the cache engine's state of the request (keys, plan, what it reused), opaque here;
- ``PrefillState``: the ids still to compute, the prompt's last logits and the prefill's times;
- ``DecodeState``: sampling, the text decoder, stop strings, the tokens and text so far.

A preempted sequence goes back to ``WAITING`` with its KV freed and its tokens kept: ``preempted()``
is the one place that says what that resets. Admitted again, it recomputes (or reloads) its prompt
and those tokens. A sampled token is first *pending*; ``accept_pending`` is the post-processing
half of a step: end-of-sequence, stop strings, length and cancellation are decided there, and the
text it produces is handed to the request's ``on_text``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvfuse.generation import Sampler, SamplingParams, StopMatcher, TokenConstraint
from kvfuse.models.cache import KVCache
from kvfuse.models.tokenizer import IncrementalDecoder
from kvfuse.reuse import Filled, Reuse
from kvfuse.sampling import TokenLogprob, choice_seed, token_logprob
from kvfuse.sampling.history import TokenHistory

from .request import Choice, Delta, GenerationResult, Request, Timings


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class PrefillState:
    """What is left of the prompt's prefill: the ids to compute in chunks, and its last logits."""

    fill: list[int] = field(default_factory=list)  # ids still to compute (chunked prefill)
    fill_start: int = 0  # the slot of fill[0]
    logits: torch.Tensor | None = None  # of the prompt's last token, once computed
    load_s: float = 0.0
    compute_s: float = 0.0

    @classmethod
    def after(cls, filled: Filled, ids: list[int]) -> PrefillState:
        """What the batched steps compute after the cache engine filled ``filled``: the prompt's
        deferred last span, then (``ids`` beyond the prompt) the tokens generated before a
        preemption. ``ids``: the prompt's and those tokens."""
        n = len(ids)
        start = filled.rest[0] if filled.rest is not None else n
        return cls(ids[start:], start, filled.logits, filled.load_s, filled.compute_s)

    def computed(self, n: int, logits: torch.Tensor, seconds: float) -> bool:
        """``n`` more ids of ``fill`` were computed (in ``seconds`` of a batched pass); True when
        that was the last of them (``logits`` are then the prompt's last)."""
        del self.fill[:n]
        self.fill_start += n
        self.compute_s += seconds
        if self.fill:
            return False
        self.logits = logits
        return True


@dataclass(eq=False)
class DecodeState:
    """Sampling and text: the tokens generated, the pending one, and when to stop.

    ``history`` (when a bias or penalty applies) adjusts the raw logits first, then the
    ``constraint`` masks them, then the ``sampler`` picks; ``top`` (None: no logprobs) is how many
    alternatives each token's logprob entry carries, read from the raw logits."""

    sampler: Sampler | None = None
    constraint: TokenConstraint | None = None  # structured output: which tokens may come next
    history: TokenHistory | None = None  # what the bias and penalties read
    top: int | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopMatcher | None = None
    eos: frozenset[int] = frozenset()
    pending: int | None = None  # sampled, not yet accepted
    pending_logprob: TokenLogprob | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    started_at: float = 0.0  # when decoding started (perf_counter)

    @classmethod
    def new(
        cls,
        p: SamplingParams,
        prompt: list[int],
        tokenizer,
        eos_token_ids,
        index: int = 0,
        history: TokenHistory | None = None,
    ) -> DecodeState:
        """The decode state of choice ``index`` of a request with ``p``: its own sampler (seed
        derived for the choice), constraint matcher, stop strings and text decoder. ``history``:
        another choice's penalty state to fork (the prompt's part is shared)."""
        if history is not None:
            history = history.fork()
        elif p.adjusts_logits:
            history = TokenHistory(p, prompt)
        return cls(
            sampler=Sampler(p, choice_seed(p.seed, index)),
            constraint=p.structure.matcher() if p.structure is not None else None,
            history=history,
            top=p.logprobs,
            decoder=IncrementalDecoder(tokenizer),
            stops=StopMatcher(p.stop),
            eos=frozenset(p.stop_token_ids)
            | (frozenset() if p.ignore_eos else frozenset(eos_token_ids)),
        )

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def sample(self, logits: torch.Tensor) -> None:
        """The next token (bias and penalties applied, within the constraint if any), pending
        until post-processing accepts it; its logprob is the raw distribution's."""
        raw = logits
        if self.history is not None:
            logits = self.history.adjust(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        self.pending = self.sampler(logits)
        if self.top is not None:
            self.pending_logprob = token_logprob(raw, self.pending, self.top)

    def take_pending(self) -> tuple[int, TokenLogprob | None]:
        token, entry = self.pending, self.pending_logprob
        self.pending, self.pending_logprob = None, None
        return token, entry

    def accepted(self, token: int, entry: TokenLogprob | None) -> None:
        """``token`` (not an end-of-sequence one) joins the output."""
        self.token_ids.append(token)
        if entry is not None:
            self.logprobs.append(entry)
        if self.history is not None:
            self.history.accept(token)
        if self.constraint is not None:
            self.constraint.accept(token)

    def choice(self, index: int) -> Choice:
        lp = list(self.logprobs) if self.top is not None else None
        return Choice(index, self.text, self.token_ids, self.finish_reason, lp)


@dataclass(eq=False)
class Sequence:
    request: Request
    reuse: Reuse
    status: SequenceStatus = SequenceStatus.WAITING
    kv: KVCache | None = None
    prefill: PrefillState = field(default_factory=PrefillState)
    decode: DecodeState = field(default_factory=DecodeState)
    started: bool = False  # planned, loaded and counted (its first token sampled)
    loading: bool = False  # admitted, its prompt planned and loaded off the step (``reuse.loader``)
    preemptions: int = 0
    logits: torch.Tensor | None = None  # the prompt's last logits (kept for Engine.score)
    timings: Timings = field(default_factory=Timings)
    t_start: float = 0.0
    choice: int = 0  # which of the request's n choices this sequence generates
    family: object | None = None  # the request's ``Choices`` once it forked (n > 1)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked (choice 0)

    @property
    def width(self) -> int:
        """Running places this sequence takes: a request's ``n`` until it forks, else one."""
        if self.choice == 0 and not self.started:
            return self.request.params.n
        return 1

    @property
    def decoding(self) -> bool:
        """Prefilled and waiting for its next token to be computed."""
        d = self.decode
        return (
            self.started and not self.prefill.fill and d.pending is None and d.finish_reason is None
        )

    @property
    def prompt_len(self) -> int:
        return len(self.reuse.prompt)

    @property
    def token_ids(self) -> list[int]:
        return self.decode.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.decode.finish_reason

    def start_clock(self) -> None:
        if not self.started:
            self.t_start = time.perf_counter()
            self.timings.queued_s = self.request.queue_wait_s

    def loaded(self, filled: Filled) -> None:
        """The cache engine filled the prompt's KV (all but what ``filled.rest`` leaves): the
        batched steps compute the rest, and the tokens generated before a preemption."""
        self.prefill = PrefillState.after(filled, self.reuse.prompt.ids + self.token_ids)

    def start_decoding(self, tokenizer, eos_token_ids) -> None:
        """The prompt's last logits are in: sample the first token (pending), note the time to it,
        and set up the sampler, text decoder, stop strings and end-of-sequence tokens."""
        pre, t, r = self.prefill, self.timings, self.reuse
        t.lookup_s = r.lookup_s
        t.load_s, t.prefill_s = r.load_s + pre.load_s, pre.compute_s
        self.logits = pre.logits
        self.decode = DecodeState.new(self.request.params, r.prompt.ids, tokenizer, eos_token_ids)
        self.decode.sample(pre.logits)
        t.ttft_s = time.perf_counter() - self.t_start
        self.started = True

    def counters(self) -> dict:
        """What this finished sequence adds to the serving loop's counters (``EngineStats``): a
        forked choice only its tokens (its request and prompt count once, with choice 0)."""
        out = {"tokens_generated": len(self.token_ids)}
        if self.choice == 0:
            out["requests"] = 1
            if self.started:
                out["prompt_tokens"] = self.prompt_len
        return out

    def preempted(self) -> None:
        """Its KV was freed to make room (the caller released it): back to waiting with what it
        generated, its prefill to redo, its pending token (if any) dropped: admitted again, it
        recomputes that token's context and samples it anew."""
        self.kv = None
        self.prefill = PrefillState()
        self.decode.take_pending()
        self.preemptions += 1

    def emit(self, piece: str, entry: TokenLogprob | None = None) -> None:
        """Hand new text (choice 0's to ``on_text``) and the accepted token's logprob entry (to
        ``on_delta``) to the request."""
        req = self.request
        if piece:
            self.decode.pieces.append(piece)
            if req.on_text is not None and self.choice == 0:
                req.on_text(piece)
        if req.on_delta is not None and (piece or entry is not None):
            req.on_delta(Delta(self.choice, piece, (entry,) if entry is not None else ()))

    def accept_pending(self) -> None:
        """Take the pending token: finish on end-of-sequence, a stop string, the length limit or
        cancellation; otherwise the sequence stays running for another decode step."""
        d = self.decode
        token, entry = d.take_pending()
        if token in d.eos:
            self._finish("stop")
            return
        d.accepted(token, entry)
        self.emit(d.stops.feed(d.decoder.push(token)), entry)
        if d.stops.stopped or (d.constraint is not None and d.constraint.done):
            self._finish("stop")
        elif len(d.token_ids) >= self.request.params.max_tokens:
            self._finish("length")
        elif self.request.cancel.is_set():
            self._finish("cancelled")

    def cancel(self) -> None:
        """Finish now with reason "cancelled" (its client left mid-prefill)."""
        self.decode.finish_reason = "cancelled"

    def _finish(self, reason: str) -> None:
        d = self.decode
        d.finish_reason = reason
        if not d.stops.stopped:  # text held back by the stop matcher or the decoder is final now
            self.emit(d.stops.feed(d.decoder.flush()))
            self.emit(d.stops.flush())

    def result(self) -> GenerationResult:
        """The request's result, from what it generated and what its prompt reused."""
        u, r = self.reuse.usage, self.reuse
        return GenerationResult(
            choices=[self.decode.choice(self.choice)],
            prompt_logprobs=self.prompt_logprobs,
            text=self.decode.text,
            token_ids=self.decode.token_ids,
            finish_reason=self.decode.finish_reason,
            prompt_tokens=self.prompt_len,
            cached_tokens=u.reused,
            timings=self.timings,
            hit_tiers=u.hit_tiers,
            stored_chunks=u.stored,
            recomputed_tokens=u.recomputed,
            kv_stream=u.kv_stream,
            written_tokens=u.written,
            history=u.kept,
            blend=r.used_blend,
            prefix_reused_tokens=u.reused - u.span_reused,
            span_reused_tokens=u.span_reused,
            auto_reuse=r.auto,
            stop_sequence=self.decode.stops.matched if self.decode.stops is not None else None,
        )
