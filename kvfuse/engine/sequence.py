"""A request's state inside the engine, from queued to finished, in typed parts.

``WAITING`` (in the queue, its keys computed) -> ``RUNNING`` (admitted: its KV memory taken,
planned, loaded; then its prompt computed in chunks, one chunk per step (``PrefillState.fill``),
then one token per step) -> ``FINISHED``.

- ``PrefillState``: the plan, what executing it produced (``Filled``) and the ids still to compute;
- ``DecodeState``: sampling, the text decoder, stop strings, the tokens and text so far;
- ``Usage``: what the request reused, recomputed, stored and kept (its ``GenerationResult``'s
  figures).

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

from kvfuse.blend.options import BlendOptions
from kvfuse.generation import Sampler, StopMatcher
from kvfuse.history.records import Record
from kvfuse.kv.keys import ChunkKey, Namespace
from kvfuse.models.cache import KVCache
from kvfuse.models.tokenizer import IncrementalDecoder
from kvfuse.reuse.auto_reuse import settled
from kvfuse.reuse.kv_stream import KVStreamReport
from kvfuse.reuse.plan_executor import Filled
from kvfuse.reuse.planner import BLENDED, Plan, PromptKeys

from .request import GenerationResult, Request, Timings


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class PrefillState:
    """The prompt's prefill: its plan, the executed plan's result, and what is left to compute."""

    plan: Plan | None = None
    filled: Filled | None = None  # set at admission; its logits once the last chunk is computed
    # ids still to compute, in chunks (chunked prefill)
    fill: list[int] = field(default_factory=list)
    fill_start: int = 0  # the slot of fill[0]
    # the chunks it computes and will store (see ComputingChunks)
    computing: frozenset[ChunkKey] = frozenset()

    def computed(self, n: int, logits: torch.Tensor, seconds: float) -> bool:
        """``n`` more ids of ``fill`` were computed (in ``seconds`` of a batched pass); True when
        that was the last of them (``logits`` are then the prompt's last)."""
        del self.fill[:n]
        self.fill_start += n
        self.filled.compute_s += seconds
        if self.fill:
            return False
        self.filled.logits = logits
        return True


@dataclass(eq=False)
class DecodeState:
    """Sampling and text: the tokens generated, the pending one, and when to stop."""

    sampler: Sampler | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopMatcher | None = None
    eos: frozenset[int] = frozenset()
    pending: int | None = None  # sampled, not yet accepted
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    started_at: float = 0.0  # when decoding started (perf_counter)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def sample(self, logits: torch.Tensor) -> None:
        """The next token, pending until post-processing accepts it."""
        self.pending = self.sampler(logits)


@dataclass
class Usage:
    """What the request's prompt reused and recomputed, and what it stored and kept."""

    reused: int = 0  # prompt tokens whose KV was loaded, not computed
    # of those, tokens of documents and found spans (blended; the rest: exact loads)
    span_reused: int = 0
    recomputed: int = 0  # document (or found span) tokens a blend recomputed in context
    span_lookups: tuple[int, int] = (0, 0)  # content chunks looked up: (found, missing)
    history_reused: int = 0  # prompt tokens loaded from a stored history's entries
    moved_reused: int = 0  # of those, at new positions
    hit_tiers: tuple[str, ...] = ()  # the tier of each entry it reused
    stored: int = 0  # entries written
    written: int = 0  # prompt tokens whose KV was handed to the cache
    # how slow-tier chunks were loaded (kv_slo_ms), if they were
    kv_stream: KVStreamReport | None = None
    kept: Record | None = None  # the history record of the KV kept when the turn ended


@dataclass(eq=False)
class Sequence:
    request: Request
    namespace: Namespace | None  # None: this request does not use the cache
    keys: PromptKeys | None
    blend: BlendOptions = field(default_factory=BlendOptions)  # for prompts with documents
    # the request came with documents: its result and counters say how they were used
    documents: bool = False
    # automatic reuse (``auto_reuse.STATUSES``): ``on`` until its prefill is planned
    auto: str = "off"
    record: Record | None = None  # the stored history this prompt was lined up with
    scope: str = ""  # where its own history record goes (the cache namespace's key prefix)
    status: SequenceStatus = SequenceStatus.WAITING
    kv: KVCache | None = None
    prefill: PrefillState = field(default_factory=PrefillState)
    decode: DecodeState = field(default_factory=DecodeState)
    usage: Usage = field(default_factory=Usage)
    started: bool = False  # planned, loaded and counted (its first token sampled)
    preemptions: int = 0
    logits: torch.Tensor | None = None  # the prompt's last logits (kept for Engine.score)
    timings: Timings = field(default_factory=Timings)
    t_start: float = 0.0

    @property
    def decoding(self) -> bool:
        """Prefilled and waiting for its next token to be computed."""
        d = self.decode
        return (
            self.started and not self.prefill.fill and d.pending is None and d.finish_reason is None
        )

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def token_ids(self) -> list[int]:
        return self.decode.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.decode.finish_reason

    def start_clock(self) -> None:
        self.t_start = time.perf_counter()
        self.timings.queued_s = self.request.queue_wait_s

    def count_prefill(self) -> None:
        """The prompt's KV is complete: count what it reused (loads from a tier, less those the KV
        stream recomputed instead, less the document tokens a blend recomputed in context), from
        which tiers, how much of it came from a stored history, and how much from blended loads
        (documents, found spans)."""
        plan, filled, u = self.prefill.plan, self.prefill.filled, self.usage
        skipped = set(filled.recomputed_loads)
        from_store = [x for x in plan.loads if x.tier is not None and x not in skipped]
        u.hit_tiers = tuple(filled.served[x.key] for x in from_store)
        u.reused = plan.reused_tokens - sum(x.end - x.start for x in skipped)
        u.kv_stream = filled.kv_stream
        self.started = True
        self.auto = settled(self.auto, len(plan.found_spans))
        if self.keys is not None and self.keys.history:
            stored = {e.key for e in self.keys.history}
            u.history_reused = plan.reused_by(lambda x: x.key in stored and x not in skipped)
            u.moved_reused = plan.reused_by(
                lambda x: x.key in stored and x.moved and x not in skipped
            )
        if plan.blended:
            recomputed = filled.recomputed_positions
            cached_slots = torch.zeros(self.prompt_len, dtype=torch.bool)
            for x in from_store:
                cached_slots[x.start : x.end] = True
            u.recomputed = int(recomputed.numel())
            u.reused -= int(cached_slots[recomputed].sum())  # recomputed in context: not reused
            u.span_reused = plan.reused_by(lambda x: x.key.kind in BLENDED) - int(
                cached_slots[recomputed].sum()
            )

    def start_decoding(self, tokenizer, eos_token_ids) -> None:
        """The prompt's last logits are in: sample the first token (pending), note the time to it,
        and set up the text decoder, stop strings and end-of-sequence tokens."""
        filled, d, t, p = self.prefill.filled, self.decode, self.timings, self.request.params
        t.load_s, t.prefill_s = t.load_s + filled.load_s, filled.compute_s
        d.sampler, self.logits = Sampler(p), filled.logits
        d.pending = d.sampler(filled.logits)
        t.ttft_s = time.perf_counter() - self.t_start
        d.eos = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else frozenset(eos_token_ids)
        )
        d.decoder, d.stops = IncrementalDecoder(tokenizer), StopMatcher(p.stop)

    def counters(self) -> dict:
        """What this finished request adds to the engine's counters (``EngineStats``)."""
        u = self.usage
        out = {"requests": 1, "tokens_generated": len(self.token_ids), "chunks_stored": u.stored}
        if self.started:
            out.update(
                prompt_tokens=self.prompt_len,
                tokens_reused=u.reused,
                tokens_prefilled=self.prompt_len - u.reused,
                tokens_recomputed=u.recomputed,
                blended_requests=int(self.prefill.plan.has_documents),
                history_requests=int(self.record is not None),
                history_tokens_reused=u.history_reused,
                moved_tokens_reused=u.moved_reused,
                hits_by_tier={tier: u.hit_tiers.count(tier) for tier in set(u.hit_tiers)},
            )
            if self.documents or self.auto == "blended":
                out["blends"] = {blend_label(self.blend): 1}
            out.update(
                auto_requests={self.auto: 1},
                span_hits=u.span_lookups[0],
                span_misses=u.span_lookups[1],
                span_tokens_reused=u.span_reused if not self.documents else 0,
            )
        return out

    def preempted(self) -> None:
        """Its KV was freed to make room (the caller released it): back to waiting with what it
        generated, its prefill to redo, its pending token (if any) dropped: admitted again, it
        recomputes that token's context and samples it anew."""
        self.kv = None
        self.prefill = PrefillState()
        self.decode.pending = None
        self.preemptions += 1

    def emit(self, piece: str) -> None:
        if piece:
            self.decode.pieces.append(piece)
            if self.request.on_text is not None:
                self.request.on_text(piece)

    def accept_pending(self) -> None:
        """Take the pending token: finish on end-of-sequence, a stop string, the length limit or
        cancellation; otherwise the sequence stays running for another decode step."""
        d = self.decode
        token, d.pending = d.pending, None
        if token in d.eos:
            self._finish("stop")
            return
        d.token_ids.append(token)
        self.emit(d.stops.feed(d.decoder.push(token)))
        if d.stops.stopped:
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
        """The request's result, from what it generated and its usage."""
        u = self.usage
        return GenerationResult(
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
            blend=self.blend if self.documents or self.auto == "blended" else None,
            prefix_reused_tokens=u.reused - u.span_reused,
            span_reused_tokens=u.span_reused,
            auto_reuse=self.auto,
        )


def blend_label(blend: BlendOptions) -> str:
    """How a request's documents were used, for counters: ``method:budget:source``."""
    return f"{blend.method}:{blend.recompute_ratio:g}:{blend.source}"
