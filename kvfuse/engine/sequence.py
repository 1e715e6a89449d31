"""A request's state inside the engine, from queued to finished.

``WAITING`` (in the queue, its keys computed) -> ``RUNNING`` (admitted: its KV memory taken,
planned, loaded; then its prompt computed in chunks (``fill``), one chunk per step, and one token
per step) -> ``FINISHED``. A preempted sequence goes back to ``WAITING`` with its KV freed and
its tokens kept; admitted again, it recomputes (or reloads) its prompt and those tokens. A sampled token is first *pending*; ``accept_pending``
is the post-processing half of a step: end-of-sequence, stop strings, length and cancellation
are decided there, and the text it produces is handed to the request's ``on_text``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvfuse.blend.options import BlendOptions
from kvfuse.generation import Sampler, StopMatcher
from kvfuse.kv.keys import Namespace
from kvfuse.models.cache import KVCache
from kvfuse.models.tokenizer import StreamDecoder

from .planner import Plan, PromptKeys
from .request import Request, Timings
from .streaming import StreamReport


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    namespace: Namespace | None  # None: this request does not use the cache
    keys: PromptKeys | None
    blend: BlendOptions = field(default_factory=BlendOptions)  # for prompts with documents
    status: SequenceStatus = SequenceStatus.WAITING
    plan: Plan | None = None
    kv: KVCache | None = None
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    stops: StopMatcher | None = None
    eos: frozenset[int] = frozenset()
    pending: int | None = None  # sampled, not yet accepted
    logits: object = None  # the prompt's last logits (kept for Engine.score)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    reused: int = 0
    recomputed: int = 0
    stream: StreamReport | None = None  # how slow-tier chunks were streamed (kv_slo_ms), if they were
    hit_tiers: tuple[str, ...] = ()
    stored: int = 0
    written: int = 0  # prompt tokens whose KV was handed to the cache
    kept: object = None  # the history record of the KV kept when the turn ended (kvfuse.history.Record)
    started: bool = False  # planned and loaded (counted in the token statistics)
    history_reused: int = 0  # prompt tokens loaded from a stored history's entries
    moved_reused: int = 0  # of those, at new positions
    record: object = None  # the stored history (kvfuse.history.Record) this prompt was lined up with
    scope: str = ""  # where its own history record goes (the cache namespace's key prefix)
    fill: list[int] = field(default_factory=list)  # ids still to compute, in chunks (chunked prefill)
    fill_start: int = 0  # the slot of fill[0]
    filled: object = None  # the prefill's result (executor.Prefilled) while ``fill`` is computed
    served: dict = field(default_factory=dict)  # the tier that served each loaded key
    streaming: bool = False  # slow-tier chunks were streamed (kv_slo_ms)
    preemptions: int = 0
    computing: set = field(default_factory=set)  # keys of the chunks it is computing and will store
    timings: Timings = field(default_factory=Timings)
    t_start: float = 0.0
    t_decode: float = 0.0

    @property
    def decoding(self) -> bool:
        """Prefilled and waiting for its next token to be computed."""
        return self.started and not self.fill and self.pending is None and self.finish_reason is None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    def start_clock(self) -> None:
        self.t_start = time.perf_counter()
        self.timings.queued_s = self.request.queue_wait_s

    def emit(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if self.request.on_text is not None:
                self.request.on_text(piece)

    def accept_pending(self) -> None:
        """Take the pending token: finish on end-of-sequence, a stop string, the length limit or
        cancellation; otherwise the sequence stays running for another decode step."""
        token, self.pending = self.pending, None
        params = self.request.params
        if token in self.eos:
            self._finish("stop")
            return
        self.token_ids.append(token)
        self.emit(self.stops.feed(self.decoder.push(token)))
        if self.stops.stopped:
            self._finish("stop")
        elif len(self.token_ids) >= params.max_tokens:
            self._finish("length")
        elif self.request.cancel.is_set():
            self._finish("cancelled")

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if not self.stops.stopped:  # text held back by the stop matcher or the decoder is final now
            self.emit(self.stops.feed(self.decoder.flush()))
            self.emit(self.stops.flush())

    @property
    def text(self) -> str:
        return "".join(self.pieces)
