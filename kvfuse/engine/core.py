"""The engine: requests in, a step at a time (schedule -> run -> post-process), results out.

``submit`` queues a request (its prompt checked and its keys computed on the caller's thread);
``step`` runs one engine step: the scheduler picks the work, the engine prefills the admitted
sequence (lookup -> plan -> fetch -> replan around unusable entries -> precompute -> load and
compute in slot order -> first token -> store) or decodes one token of the running ones, and
post-processing accepts the sampled tokens, streams their text and finishes sequences (stop,
length, cancel). A plain prompt is first lined up with a stored conversation history
(``kvfuse.history``); when its turn ends, the ids its KV holds are recorded and the new entries
(the answer's chunks, the partial last chunk as a tail) go to the ``Saver`` thread, like the
prompt's new chunks after the prefill: no request waits for a store write. ``encode_chat``
drops the oldest turns of a conversation beyond the context window. ``generate`` is submit +
steps until that request is done, on the caller's thread or, after ``start()``, on the engine's
own loop thread.

A loaded chunk holds exactly what a prefill of its tokens writes (the live KV has the stored
dtype) and moved keys are rotated exactly (``rope``), so greedy output with a cache hit is the
output without one up to float rounding: computing a prompt in two parts (the cached one, then
the rest) sums in another order than computing it whole, which can flip a near-tie. The server
reads statistics and clears tenants only through the narrow API at the end of this class
(``stats_snapshot``, ``cache_stats``, ``clear_cache``, ``queue_state``).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import replace

import numpy as np
import torch

from kvfuse.blend import BlendOptions, LayerLoadFailed
from kvfuse.codecs import get_codec
from kvfuse.generation import Sampler, SamplingParams, StopMatcher
from kvfuse.history import Alignment, HistoryIndex, Record, Run, align, drop_oldest_turns
from kvfuse.kv.keys import ChunkKey, Namespace, document_key, layout_of, tenant_tag
from kvfuse.models import LoadedModel
from kvfuse.models.cache import KVBudget, OutOfKVMemory, slot_bytes
from kvfuse.models.tokenizer import StreamDecoder
from kvfuse.models.transformer import BatchItem
from kvfuse.tiers.prefetch import Prefetcher
from kvfuse.tiers.store import TieredStore

from . import encode, executor
from .loop import EngineLoop
from .planner import (Precompute, Store, breakpoint_stores, full_prefill, generated_stores, history_entries,
                      prompt_keys, replan, tail_probe)
from .prompt import Prompt, SegmentKind
from .request import CacheOptions, GenerationResult, Outcome, Request, RequestCancelled, Timings
from .retention import Retention, keep_until, write_policy
from .saver import Saver
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats
from .stream_loader import stream_prefill
from .streaming import LoadEstimates, StreamReport

log = logging.getLogger(__name__)

KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TRUNCATION = ("reuse", "recompute", "off")
# Slots a sequence is admitted with beyond its prompt (its cache grows as it decodes): enough for
# short answers without a reallocation, without reserving max_tokens up front.
DECODE_HEADROOM = 64
# Prompt tokens the oldest prompt being computed gets in every step, even when decodes use up
# engine.max_step_tokens: no prompt waits for the decodes to end.
MIN_PREFILL_CHUNK = 16
# Histogram buckets of sequences / tokens per step (powers of two).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def _bucket(n: int) -> str:
    """The smallest bucket >= n (the last one for anything larger), as a counter key."""
    return str(next((b for b in BUCKETS if n <= b), BUCKETS[-1]))
EVICTION = ("queue", "lru")


class Engine:
    """Generation over one model with an optional tiered KV store."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None = None,
        *,
        chunk_size: int = 256,
        kv_dtype: str = "float16",
        codec: str = "raw",
        codec_level: int = 0,
        store_generated: bool = False,
        salt: str = "",
        max_waiting: int = 64,
        blend: BlendOptions = BlendOptions(),
        history: bool = True,
        history_records: int = 2048,
        history_path: str | None = None,
        truncation: str = "reuse",
        context_tokens: int = 0,
        async_save: bool = True,
        prefetch: bool = True,
        eviction: str = "queue",
        kv_slo_ms: float | None = None,
        retention: Retention | None = None,
        max_running: int = 16,
        max_step_tokens: int = 256,
        kv_memory_bytes: int | None = None,
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATION)}, got {truncation!r}")
        if eviction not in EVICTION:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION)}, got {eviction!r}")
        self.model = model
        self.store = store
        self.chunk_size = chunk_size
        self.kv_dtype_name = kv_dtype
        self.kv_dtype = KV_DTYPES[kv_dtype]
        self.codec = get_codec(codec, codec_level)  # how this engine writes entries; any codec is read
        if kv_slo_ms is not None and not kv_slo_ms > 0:
            raise ValueError(f"kv_slo_ms must be > 0 (or None: no streaming), got {kv_slo_ms}")
        # Bandwidth-adaptive loading of chunks in slow tiers within this budget (engine/streaming.py).
        self.kv_slo_ms = kv_slo_ms
        self.estimates = LoadEstimates()
        self.store_generated = store_generated
        self.retention = retention  # of requests that do not say (prompt_cache_retention)
        self.base_salt = salt
        self.blend = blend
        if blend.check_layer >= model.config.num_layers:
            raise ValueError(f"blend check_layer {blend.check_layer} is not a layer of this model "
                             f"({model.config.num_layers} layers)")
        self.stats = EngineStats()
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        # Continuous batching: up to max_running sequences per step, max_step_tokens tokens per
        # forward pass (decodes, then prompt chunks), their live KV within kv_memory_bytes.
        self.scheduler = Scheduler(max_waiting, max_running)
        self.max_step_tokens = max_step_tokens
        self.kv_budget = KVBudget(kv_memory_bytes)
        self._computing: set[ChunkKey] = set()  # chunks running sequences are computing and will store
        self._admitting: set[ChunkKey] = set()  # prefix keys of the sequences admitted in this step
        self._active: dict[Request, Sequence] = {}
        self._active_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._loop: EngineLoop | None = None
        self._closed = False
        c = model.config
        self._layout = layout_of(c.num_layers, c.num_kv_heads, c.head_dim)
        self.context_window = min(c.max_position_embeddings, context_tokens or c.max_position_embeddings)
        self.truncation = truncation
        # Conversations: the ids each stored history was built from (found again for a later turn),
        # its KV saved off the request path, queued requests' KV prefetched and kept in memory.
        self.history = HistoryIndex(history_records, history_path) if store is not None and history else None
        self._token_bytes = None
        self.saver = Saver(store) if store is not None and async_save else None
        self.prefetcher = None
        if store is not None:
            store.set_lookahead(self.scheduler.upcoming_keys)
            store.protect_upcoming(eviction == "queue")
            if prefetch and len(store.tiers) > 1:
                self.prefetcher = Prefetcher(store)

    # ------------------------------------------------------------------------------ namespaces

    def namespace(self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None) -> Namespace:
        """The cache namespace of this model/KV format for ``tenant``, inside request ``salt``; with
        ``blend``, the namespace of prompts blended with those options (``BlendOptions.identity``)."""
        full_salt = self.base_salt + ("\x00" + salt if salt else "") + ("\x00" + blend.identity() if blend else "")
        return Namespace(
            tenant=tenant,
            model_fingerprint=self.model.fingerprint,
            kv_dtype=self.kv_dtype_name,
            kv_layout=self._layout,
            salt=full_salt,
        )

    # ------------------------------------------------------------------------------ prompting

    def encode_prompt(self, prompt: str | Seq[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids for a text prompt, a list of ids, or chat ``messages`` (rendered by the chat template)."""
        tok = self.model.tokenizer
        if messages is not None:
            return tok.encode_chat(messages)
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if prompt is None:
            raise ValueError("give a prompt or messages")
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids

    def encode_chat(self, messages: list[dict], reserve: int = 0) -> tuple[list[int], int]:
        """The ids of chat ``messages`` and how many messages were dropped to make them fit: when
        they and ``reserve`` more tokens (the answer) exceed the context window, the oldest turns
        go (``truncation``, not "off"), keeping the system prompt and the last message. The ids
        are the full conversation's when nothing fits (``check`` then reports it)."""
        tok = self.model.tokenizer
        ids = tok.encode_chat(messages)
        if self.truncation == "off" or len(ids) + reserve <= self.context_window:
            return ids, 0
        lengths: dict[int, list[int]] = {}

        def fits(msgs: list[dict]) -> bool:
            lengths[len(msgs)] = tok.encode_chat(msgs)
            return len(lengths[len(msgs)]) + reserve <= self.context_window

        kept = drop_oldest_turns(messages, fits)
        if kept is None:
            return ids, 0
        self.stats.add(truncated_requests=1, truncated_messages=len(messages) - len(kept))
        return lengths[len(kept)], len(messages) - len(kept)

    def encode_document(self, text: str) -> list[int]:
        """A document's token ids, the same wherever it is used (``engine.encode``)."""
        return encode.encode_document(self.model.tokenizer, text)

    def document_prompt(self, documents: Seq[str], prompt: str | None = None,
                        messages: list[dict] | None = None) -> Prompt:
        """A prompt with ``documents``: before a completion ``prompt``, or at the start of the last
        user message of chat ``messages``. ValueError (naming the document) for bad input."""
        if messages is not None:
            return encode.chat_prompt(self.model.tokenizer, documents, messages)
        if not isinstance(prompt, str):
            raise ValueError("documents need a text prompt, not token ids")
        return encode.completion_prompt(self.model.tokenizer, documents, prompt)

    def breakpoint_positions(self, messages: list[dict], marks: Seq[tuple[int, int]], ids: Seq[int]) -> list[int | None]:
        """Prompt positions of cache breakpoints at ``marks`` (message index, character offset in its
        content) of chat ``messages`` rendered as ``ids`` (``encode.breakpoint_positions``)."""
        return encode.breakpoint_positions(self.model.tokenizer, messages, marks, ids)

    def document_context(self, blend: BlendOptions | None = None) -> tuple[int, ...]:
        """What documents' KV is computed behind when cached on their own (``document_context``)."""
        bos = self.model.tokenizer.bos_token_id
        return (bos,) if (blend or self.blend).document_context == "bos" and bos is not None else ()

    def check(self, prompt: Prompt, params: SamplingParams) -> None:
        """ValueError when prompt + max_tokens exceeds the model's context window."""
        limit = self.context_window
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context window "
                f"of {limit} tokens"
            )

    # ------------------------------------------------------------------------------ requests

    def submit_check(self, request: Request) -> None:
        """ValueError for a request that cannot run (context window, blend options, documents
        without a cache)."""
        self.check(request.prompt, request.params)
        blend = request.blend or self.blend
        if blend.check_layer >= self.model.config.num_layers:
            raise ValueError(f"blend check_layer {blend.check_layer} is not a layer of this model")
        if request.prompt.documents and (self.store is None or not request.cache.enabled):
            raise ValueError("documents need the KV cache: it is disabled for this request")
        limit = self.kv_budget.limit
        slots = len(request.prompt) + request.params.max_tokens
        need = slots * slot_bytes(self.model.config, self.kv_dtype)
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_tokens}) needs "
                f"{need / 2**20:.1f} MiB of live KV, more than the engine's whole KV memory budget "
                f"({limit / 2**20:.1f} MiB, engine.kv_memory_bytes): shorten the prompt, lower max_tokens "
                f"or raise the budget")

    def _sequence(self, request: Request) -> Sequence:
        """A request's sequence, with its keys computed (hashing only)."""
        blend = request.blend or self.blend
        ns, keys = None, None
        if self.store is not None and request.cache.enabled:
            c = request.cache
            ns = self.namespace(c.tenant, c.salt)
            if self.history is not None and self._is_history(request.prompt):
                return self._history_sequence(request, ns, blend)
            blend_ns = self.namespace(c.tenant, c.salt, blend) if blend.store_blended else None
            keys = prompt_keys(request.prompt, self.chunk_size, ns, self.document_context(blend), blend_ns,
                               chain_over_suffix=blend.query_aware)
        return Sequence(request, ns, keys, blend)

    @staticmethod
    def _is_history(prompt: Prompt) -> bool:
        """Whole-history reuse applies to plain prompts (one prefix segment: chat and completions
        without documents)."""
        return len(prompt.segments) == 1 and prompt.segments[0].kind is SegmentKind.PREFIX

    def _history_sequence(self, request: Request, ns: Namespace, blend: BlendOptions) -> Sequence:
        """A plain prompt lined up against the stored history that covers most of it (found by
        ``prompt_cache_key`` or content): the prompt runs with the stored ids where they spell
        the same text, its keys name that history's entries for the slots they fill."""
        scope = ns.key_prefix()
        ids = request.prompt.ids
        best: tuple[Record, Alignment] | None = None
        if self._token_bytes is None:
            self._token_bytes = self.model.tokenizer.token_bytes() or ()
        table = self._token_bytes or None
        candidates = self.history.candidates(scope, ids, request.cache.history_key)
        hint = request.cache.history_hint
        if hint is not None and hint.scope == scope:  # e.g. a previous_response_id's history: tried first
            candidates.insert(0, hint)
        for rec in candidates:
            al = align(rec.ids.tolist(), ids, table, allow_gap=self.truncation == "reuse")
            if al.reusable and (best is None or al.reusable > best[1].reusable):
                best = (rec, al)
        seq_ns, record, entries, runs = ns, None, (), ()
        if best is not None and len(best[1].ids) + request.params.max_tokens <= self.context_window:
            record, al = best
            request.prompt = Prompt.plain(al.ids)
            seq_ns = self._derived(record, al) if al.moved else record.namespace
            entries, runs = record.entries, al.runs
        keys = prompt_keys(request.prompt, self.chunk_size, seq_ns).with_history(entries, runs)
        seq = Sequence(request, seq_ns, keys, blend)
        seq.record, seq.scope = record, scope
        if record is None:  # found by content, if at all: known now, so that the queue can prefetch it
            self._probe_tail(seq, self.store.lookup(keys.all(), count=False).where)
        return seq

    @staticmethod
    def _derived(record: Record, al: Alignment) -> Namespace:
        """The namespace of a conversation continued after its oldest turns were dropped with the
        KV kept (moved runs): its KV is not a plain prefill's, so it never shares keys with one.
        Named by what it was derived from, so the same truncation gives the same namespace."""
        end = max(r.source + len(r) for r in al.runs)
        h = hashlib.sha256(record.namespace.short_id().encode())
        h.update(np.ascontiguousarray(record.ids[:end], dtype="<u4").tobytes())
        for r in al.runs:
            h.update(struct.pack("<QQQ", r.start, r.end, r.source))
        return replace(record.namespace, salt=record.namespace.salt + "\x00history:" + h.hexdigest()[:32])

    def submit(self, request: Request) -> None:
        """Queue ``request``. ValueError for a prompt that cannot run; QueueFull / QueueClosed."""
        self.submit_check(request)
        seq = self._sequence(request)
        with self._active_lock:
            self._active[request] = seq
        try:
            self.scheduler.add(seq)
        except Exception:
            with self._active_lock:
                self._active.pop(request, None)
            raise
        if self.prefetcher is not None:
            self.prefetcher.wake()

    def withdraw(self, request: Request) -> None:
        """The client of ``request`` left: drop it if it waits, stop it at its next step if it runs."""
        request.cancel.set()
        with self._active_lock:
            seq = self._active.get(request)
        if seq is not None and self.scheduler.remove(seq):
            self._skip(seq, "the client left while the request was queued")
        self.scheduler.wake()

    def generate(
        self,
        prompt: Seq[int] | Prompt,
        params: SamplingParams = SamplingParams(),
        *,
        cache: CacheOptions = CacheOptions(),
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        blend: BlendOptions | None = None,
    ) -> GenerationResult:
        """Generate from ``prompt`` (token ids or a ``Prompt``) and wait for the result;
        ``on_text`` receives text pieces as they are decoded.

        ``cancel`` is checked between steps (finish reason "cancelled"). Raises ValueError when
        the prompt is empty or prompt + max_tokens exceeds the model's context window.
        """
        if not isinstance(prompt, Prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("the prompt is empty")
            prompt = Prompt.plain(ids)
        done = threading.Event()
        outcome: list[Outcome] = []

        def on_done(o: Outcome) -> None:
            outcome.append(o)
            done.set()

        request = Request(prompt, params, cache, blend=blend, on_text=on_text, on_done=on_done,
                          cancel=cancel if cancel is not None else threading.Event())
        self.submit(request)
        while not done.is_set():
            if self._loop is not None and self._loop.is_alive():
                done.wait(0.1)
            else:
                self.step()
        o = outcome[0]
        if isinstance(o.error, RequestCancelled):
            return GenerationResult("", [], "cancelled", len(prompt), 0, Timings())
        if o.error is not None:
            raise o.error
        return o.result

    def precompute_documents(self, texts: Seq[str], cache: CacheOptions = CacheOptions(),
                             blend: BlendOptions | None = None,
                             on_document: Callable[[int, bool], None] | None = None) -> dict[str, int]:
        """Compute and store the KV of each document not cached yet (as a blended prompt would:
        alone, behind the document context); ``on_document(tokens, computed)`` after each one.
        Returns counts: documents, computed, already cached, tokens. Runs between engine steps."""
        if self.store is None:
            raise ValueError("precompute needs the KV cache, and it is disabled in this configuration")
        ns = self.namespace(cache.tenant, cache.salt)
        context = self.document_context(blend)
        counts = {"documents": 0, "computed": 0, "cached": 0, "tokens": 0}
        for i, text in enumerate(texts):
            try:
                ids = self.encode_document(text)
            except ValueError as e:
                raise ValueError(f"document {i}: {e}") from None
            if len(context) + len(ids) > self.model.config.max_position_embeddings:
                raise ValueError(f"document {i} has {len(ids)} tokens: more than the model's context window")
            key = document_key(ids, ns, context)
            computed = self.store.lookup([key]).where[0] is None
            if computed:
                with self._step_lock:
                    entry = executor.precompute(self.model.runner, self.kv_dtype, self.codec,
                                                Precompute(key, tuple(ids), context))
                expires_at, memory_only = write_policy(len(ids), cache.retention or self.retention,
                                                       cache.breakpoints, self.store.tiers[0].clock())
                self.store.put([(key, entry)], expires_at=expires_at, memory_only=memory_only)
            counts["documents"] += 1
            counts["computed" if computed else "cached"] += 1
            counts["tokens"] += len(ids)
            if on_document is not None:
                on_document(len(ids), computed)
        self.stats.add(chunks_stored=counts["computed"])
        return counts

    def score(self, prompt: Seq[int] | Prompt, continuations: Seq[Seq[int]] = (), *,
              cache: CacheOptions = CacheOptions(), blend: BlendOptions | None = None) -> list[torch.Tensor]:
        """Teacher-forced logits after ``prompt`` prefilled exactly as a request would be (lookup,
        plan, loads, blend): for each continuation, a ``(len + 1, vocab)`` tensor of the logits
        predicting its tokens and the one after (the first row predicts its first token). Nothing
        is generated and the answers are not stored. For measuring lossy reuse (blends, codecs)
        against a full prefill: KL of next-token distributions, NLL of reference answers."""
        if not isinstance(prompt, Prompt):
            prompt = Prompt.plain(list(prompt))
        request = Request(prompt, SamplingParams(max_tokens=1 + max((len(c) for c in continuations), default=0)),
                          cache, blend=blend)
        self.submit_check(request)
        seq = self._sequence(request)
        with self._step_lock:
            request.started_at = request.enqueued_at
            self._prefill(seq, chunked=False)
            out, n = [], len(prompt)
            for cont in continuations:
                seq.kv.truncate(n)
                rows = [seq.logits[None]]
                if len(cont):
                    rows.append(self.model.runner.forward(list(cont), seq.kv, logits="all").to(seq.logits.dtype))
                out.append(torch.cat(rows))
            seq.kv = None
        return out if continuations else [seq.logits[None]]

    # ------------------------------------------------------------------------------ steps

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One engine step: schedule, run, post-process. Returns the requests it finished.

        Admitted sequences are planned and loaded; then one batched forward pass
        (``Transformer.forward_batch``) computes the next token of every decoding sequence and the
        next chunk of every prompt still being computed, within ``max_step_tokens`` (decodes
        first, then prompt chunks oldest first). A sequence whose KV cannot grow preempts the most
        recently admitted one (``_make_room``)."""
        with self._step_lock:
            self._admitting = set()
            scheduled = self.scheduler.schedule(self._take_memory, self._computing_prefix)
            if not scheduled.running and not scheduled.skipped and self.scheduler.has_work():
                self._wait_for_memory()
            finished: list[Sequence] = []
            for seq in scheduled.skipped:
                self._skip(seq, "the client left while the request was queued")
                finished.append(seq)
            for seq in scheduled.admitted:
                if not self._guard(seq, self._prefill):
                    finished.append(seq)
            running = [s for s in scheduled.running if s.status is SequenceStatus.RUNNING]
            items, batch = self._batch([s for s in running if s.finish_reason is None])
            if items:
                self._run_batch(items, batch)
            items = batch = None  # nothing of this step may hold a finished sequence's KV
            for seq in running:
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted in this step
                if seq.pending is not None and seq.finish_reason is None:
                    seq.accept_pending()
                elif seq.fill and seq.request.cancel.is_set():
                    seq.finish_reason = "cancelled"
                if seq.finish_reason is not None:
                    self._guard(seq, self._complete)
                    finished.append(seq)
            return [s.request for s in finished]

    def _wait_for_memory(self) -> None:
        """Nothing runs, yet the oldest waiting sequence did not fit: the KV it needs is still held
        by finished sequences whose chunks the saver is copying out (or by a reference cycle).
        Wait for the saver rather than spin on empty steps."""
        if self.saver is not None:
            self.saver.flush(timeout=0.5)
        gc.collect()

    def _computing_prefix(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing one of ``seq``'s chunks now (it will store it):
        ``seq`` then waits a step or a few and loads it, rather than computing it a second time
        in the same batch (several requests with one document set arriving together)."""
        if seq.keys is None or not (self._computing or self._admitting):
            return False
        # Admitted in this very step: not planned yet, so all of its prefix counts as computing.
        return any(k in self._computing or k in self._admitting for k in seq.keys.prefix)

    def _take_memory(self, seq: Sequence) -> bool:
        """The scheduler's admission test: allocate ``seq``'s live KV from the budget (its prompt,
        the tokens it already generated if it was preempted, and room to decode), or say no."""
        if seq.kv is None:
            try:
                seq.kv = self.model.runner.new_cache(self._initial_slots(seq), dtype=self.kv_dtype,
                                                     budget=self.kv_budget)
            except OutOfKVMemory:
                return False
        if seq.keys is not None and not seq.started:
            self._admitting.update(seq.keys.prefix)
        return True

    def _initial_slots(self, seq: Sequence) -> int:
        p = seq.request.params
        left = p.max_tokens - len(seq.token_ids)
        return seq.prompt_len + len(seq.token_ids) + max(1, min(left, DECODE_HEADROOM))

    def _batch(self, running: list[Sequence]) -> tuple[list[BatchItem], list[tuple[Sequence, int]]]:
        """This step's forward pass: a token for every decoding sequence, then prompt chunks
        within the token budget. Makes room in the KV budget first (preempting if needed)."""
        batch: list[tuple[Sequence, int]] = []  # (sequence, tokens it computes now)
        budget = self.max_step_tokens
        order = [s for s in running if s.decoding] + [s for s in running if s.fill]
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an older one
            if seq.fill and seq.request.cancel.is_set():
                continue  # ends in post-processing
            # Decodes always run; prompt chunks share what is left of the token budget, the oldest
            # prompt at least MIN_PREFILL_CHUNK tokens so that it progresses under any decode load.
            floor = MIN_PREFILL_CHUNK if not any(s.fill for s, _ in batch) else 0
            n = 1 if not seq.fill else min(len(seq.fill), max(budget, floor))
            if n <= 0:
                continue
            if not self._make_room(seq, (seq.fill_start if seq.fill else seq.kv.length) + n):
                continue
            batch.append((seq, n))
            budget -= n
        # Room was made before any item refers to a cache: a preempted sequence's KV is free now.
        batch = [(seq, n) for seq, n in batch if seq.status is SequenceStatus.RUNNING]
        items = []
        for seq, n in batch:
            if seq.fill:
                start = seq.fill_start
                items.append(BatchItem(seq.fill[:n], seq.kv, positions=torch.arange(start, start + n),
                                       logits=n == len(seq.fill), start=start))
            else:
                items.append(BatchItem([seq.token_ids[-1]], seq.kv))
        return items, batch

    def _make_room(self, seq: Sequence, total: int) -> bool:
        """Grow ``seq``'s KV to ``total`` slots, preempting the most recently admitted running
        sequences (``seq`` itself last) until it fits. False if ``seq`` was preempted."""
        while True:
            try:
                seq.kv.reserve(total)
                return True
            except OutOfKVMemory:
                victims = [s for s in self.scheduler.running() if s.status is SequenceStatus.RUNNING]
                victim = next((s for s in reversed(victims) if s is not seq), seq)
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV and queue it again (first in line), keeping its tokens: admitted
        again, it reloads or recomputes its prompt and those tokens, then goes on decoding."""
        log.info("request %s preempted (KV budget full) after %d tokens", seq.request.request_id, len(seq.token_ids))
        if self.saver is not None and seq.plan is not None and seq.plan.stores:
            self.saver.wait(s.key for s in seq.plan.stores)  # its prompt's chunks, copied out first
        seq.kv.release()  # its bytes are back in the budget now
        self._done_computing(seq)
        seq.kv, seq.fill, seq.filled, seq.pending = None, [], None, None
        seq.preemptions += 1
        self.stats.add(preemptions=1)
        self.scheduler.preempt(seq)

    def _run_batch(self, items: list[BatchItem], batch: list[tuple[Sequence, int]]) -> None:
        """The forward pass, then per sequence: a sampled token, or a prompt chunk done (and the
        first token when it was the last chunk). A failure ends the sequences of this pass."""
        t0 = time.perf_counter()
        try:
            logits = self.model.runner.forward_batch(items)
        except Exception as e:
            log.exception("a batched step of %d sequences failed", len(items))
            for seq, _ in batch:
                self._end(seq, Outcome(error=e))
            return
        dt = time.perf_counter() - t0
        tokens = sum(n for _, n in batch)
        self.stats.add(steps=1, step_sequences=len(batch), step_tokens=tokens,
                       batch_sizes={_bucket(len(batch)): 1}, step_token_counts={_bucket(tokens): 1})
        for (seq, n), out in zip(batch, logits):
            if not seq.fill:
                self._guard(seq, lambda s: setattr(s, "pending", s.sampler(out)))
                continue
            del seq.fill[:n]
            seq.fill_start += n
            seq.filled.compute_s += dt * n / tokens
            if not seq.fill:
                seq.filled.logits = out
                self._guard(seq, self._prefilled)

    def _guard(self, seq: Sequence, fn: Callable[[Sequence], None]) -> bool:
        """Run one part of a step for ``seq``; an exception ends that request, not the engine."""
        try:
            fn(seq)
            return True
        except Exception as e:
            if not isinstance(e, ValueError):
                log.exception("request %s failed in the engine", seq.request.request_id)
            # Logged: the traceback's frames would keep the sequence's KV (and its budget) alive
            # for as long as the outcome is kept.
            e.__traceback__ = None
            self._end(seq, Outcome(error=e))
            return False

    def _prefill(self, seq: Sequence, chunked: bool = True) -> None:
        """Admission: lookup, plan, fetch, precompute and load; a plain prompt's last compute is
        left to the batched steps (``seq.fill``, with ``chunked``), anything else is prefilled now.
        A preempted sequence admitted again also computes the tokens it had generated."""
        if not seq.started:
            seq.start_clock()
        req, t = seq.request, seq.timings
        prompt, runner = req.prompt, self.model.runner
        unusable: set[ChunkKey] = set()
        where = None
        streaming, slo_ms = False, None
        if seq.kv is None:  # Engine.score: outside the scheduler and its budget
            seq.kv = runner.new_cache(self._initial_slots(seq), dtype=self.kv_dtype)
        for _ in range(4):  # an entry unreadable mid-prefill: plan around it and start again
            entries: dict = {}
            served: dict[ChunkKey, str] = {}
            if seq.keys is None:
                plan = full_prefill(prompt)
            else:
                t0 = time.perf_counter()
                if where is None:
                    if self.saver is not None:
                        self.saver.wait(seq.keys.all())  # the previous turn's KV, if still being saved
                    where = self.store.lookup(seq.keys.all()).where
                    if self._is_history(prompt) and not seq.keys.runs:
                        # a tail entry after the chain's hits: a stored history's, or a breakpoint's
                        where = self._probe_tail(seq, where)
                    t.lookup_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                plan = replan(prompt, seq.keys, where, unusable)
                slo_ms = req.cache.kv_slo_ms if req.cache.kv_slo_ms is not None else self.kv_slo_ms
                streaming = bool(slo_ms) and not plan.has_documents and any(
                    executor.streamed(self.store, x) for x in plan.loads)
                rejected, todo = 0, plan
                while True:
                    fetched = executor.fetch(self.store, runner, self.kv_dtype, todo, prompt.ids,
                                             pipelined=plan.has_documents, streaming=streaming)
                    rejected += fetched.rejected
                    entries.update(fetched.entries)
                    served.update(fetched.served)
                    if not fetched.unusable:
                        break
                    # Planned around unusable entries, a prompt can load entries the plan before did
                    # not (a stored history's entry over slots the chain covered until its damaged
                    # chunk broke it): those are read and checked too, never loaded unread (that was
                    # a KeyError, a 500). Each round adds keys to ``unusable``, so this ends.
                    unusable |= fetched.unusable
                    plan = replan(prompt, seq.keys, where, unusable)
                    todo = replace(plan, loads=tuple(x for x in plan.loads if x.key not in entries))
                t.load_s += time.perf_counter() - t0
                self.stats.add(chunk_load_failures=rejected)
            seq.plan = plan
            if req.cancel.is_set():  # e.g. the client left just as the request was admitted
                seq.finish_reason = "cancelled"
                return
            for pre in plan.precomputes:
                if pre.key not in entries:
                    entries[pre.key] = executor.precompute(runner, self.kv_dtype, self.codec, pre)
                    end = max((x.end for x in plan.loads if x.key == pre.key), default=len(prompt))
                    expires_at, memory_only = self._write_policy(req, end)
                    self.store.put([(pre.key, entries[pre.key])], expires_at=expires_at, memory_only=memory_only)
                    seq.stored += 1
            seq.kv.truncate(0)
            if not plan.has_documents:
                try:
                    if streaming:
                        filled = stream_prefill(runner, seq.kv, prompt.ids, plan, entries, self.store,
                                                self.kv_dtype, slo_ms / 1000, self.estimates)
                        served.update(filled.served)
                    else:
                        filled = executor.prefill(runner, seq.kv, prompt.ids, plan, entries, defer_last=chunked)
                except executor.EntryUnusable as e:  # a payload its codec rejects: a miss, never used
                    log.warning("request %s: %s; computing it instead", req.request_id, e)
                    self.stats.add(chunk_load_failures=1)
                    self.store.discard(e.key)
                    unusable.add(e.key)
                    continue
                break
            try:
                filled = executor.prefill_blended(runner, seq.kv, prompt.ids, plan, entries, self.store,
                                                  self.kv_dtype, seq.blend)
            except LayerLoadFailed as e:
                log.warning("request %s: %s; computing it instead", req.request_id, e)
                self.stats.add(chunk_load_failures=1)
                unusable.add(e.key)
                continue
            served.update({d.key: d.tier for d in filled.loader.docs if d.tier is not None})
            break
        else:
            raise RuntimeError("documents could not be loaded after several attempts")
        seq.filled, seq.served, seq.streaming = filled, served, streaming
        if plan.stores and not seq.started:
            seq.computing = {st.key for st in plan.stores}
            self._computing |= seq.computing
        # What is left to compute: the prompt's last span (chunked), then the tokens generated
        # before a preemption; the batched steps compute them and call _prefilled.
        start = filled.rest[0] if filled.rest is not None else len(prompt)
        if filled.rest is not None and filled.rest[1] != len(prompt):
            raise RuntimeError("a plan's last compute must end the prompt")
        seq.fill_start, seq.fill = start, (prompt.ids + seq.token_ids)[start:]
        if not seq.fill:
            self._prefilled(seq)

    def _prefilled(self, seq: Sequence) -> None:
        """The prompt's KV is complete and ``seq.filled.logits`` are its last token's: sample the
        first token, count what was reused, store the new chunks. A preempted sequence admitted
        again only samples its next token (all of that happened the first time)."""
        filled, plan, served, streaming = seq.filled, seq.plan, seq.served, seq.streaming
        seq.filled = None
        if seq.started:  # re-admitted after a preemption
            seq.pending = seq.sampler(filled.logits)
            return
        req, t, prompt = seq.request, seq.timings, seq.request.prompt
        skipped = set(getattr(filled, "recomputed", ()))  # streamed loads computed instead
        from_store = [x for x in plan.loads if x.tier is not None and x not in skipped]
        seq.hit_tiers = tuple(served[x.key] for x in from_store)
        seq.reused, seq.started = plan.reused_tokens - sum(x.end - x.start for x in skipped), True
        if streaming:
            self._count_stream(filled.report)
            seq.stream = filled.report
        elif not plan.has_documents and plan.computed_tokens:
            self.estimates.computed(plan.computed_tokens, filled.compute_s)
        if seq.keys is not None and seq.keys.history:
            stored = {e.key for e in seq.keys.history}
            seq.history_reused = plan.reused_by(lambda x: x.key in stored and x not in skipped)
            seq.moved_reused = plan.reused_by(lambda x: x.key in stored and x.moved and x not in skipped)
        if plan.has_documents:
            recomputed = filled.recomputed_positions
            cached_slots = torch.zeros(len(prompt), dtype=torch.bool)
            for x in from_store:
                cached_slots[x.start : x.end] = True
            seq.recomputed = int(recomputed.numel())
            seq.reused -= int(cached_slots[recomputed].sum())  # recomputed in context: not reused
        t.load_s += filled.load_s
        t.prefill_s = filled.compute_s
        seq.sampler, seq.logits = Sampler(req.params), filled.logits
        seq.pending = seq.sampler(filled.logits)
        t.ttft_s = time.perf_counter() - seq.t_start
        t0 = time.perf_counter()
        if plan.has_documents:
            self.store.promote(filled.loader.promotions(self.codec))  # documents read from below, after the TTFT
        elif streaming:
            self.store.promote(filled.promotions)
        stores = list(plan.stores)
        if seq.keys is not None and req.cache.breakpoints and self._is_history(prompt):
            stores += breakpoint_stores(prompt.ids, seq.keys.prefix, req.cache.breakpoints, self.chunk_size,
                                        seq.namespace, {s.key for s in stores})
        if stores:
            seq.stored += self._save(seq, stores, skip_held=len(stores) > len(plan.stores))
        self._retain(seq, plan.loads)
        self._done_computing(seq)
        t.store_s = time.perf_counter() - t0
        p = req.params
        seq.eos = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.model.eos_token_ids))
        seq.decoder, seq.stops = StreamDecoder(self.model.tokenizer), StopMatcher(p.stop)
        seq.t_decode = time.perf_counter()

    def _probe_tail(self, seq: Sequence, where: tuple) -> tuple:
        """No record of a stored history lines up with this prompt (e.g. after a restart): look
        for one by content, a tail entry after the chain's hits, longest first."""
        keys, ids = seq.keys, seq.request.prompt.ids
        hits = next((i for i, w in enumerate(where[: len(keys.prefix)]) if w is None), len(keys.prefix))
        if hits * self.chunk_size >= len(ids):
            return where
        probe = tail_probe(ids, keys.prefix, hits, self.chunk_size, seq.namespace)
        if self.saver is not None and seq.status is SequenceStatus.RUNNING:
            self.saver.wait(e.key for e in probe)
        found = self.store.lookup([e.key for e in probe], count=False).where
        for entry, tier in zip(probe, found):
            if tier is not None:
                end = min(entry.source + entry.tokens, len(ids))
                seq.keys = keys.with_history([entry], [Run(entry.source, end, entry.source)])
                return tuple(where) + (tier,)
        return where

    def _count_stream(self, report: StreamReport) -> None:
        self.stats.add(streamed_requests=1, stream_slo_violations=int(not report.met),
                       stream_chunks=dict(report.chunks), stream_bytes=report.bytes_read)

    def _write_policy(self, req: Request, end: int) -> tuple[float | None, bool]:
        """``(expires_at, memory_only)`` of an entry of ``req``'s KV ending at token ``end``."""
        c = req.cache
        return write_policy(end, c.retention or self.retention, c.breakpoints, self.store.tiers[0].clock())

    def _save(self, seq: Sequence, spans, skip_held: bool = False) -> int:
        """Store spans of ``seq``'s live cache, each group of spans with its retention (expiry,
        memory only): handed to the saver thread, or written now without one."""
        req, kv = seq.request, seq.kv
        ids = req.prompt.ids + list(seq.token_ids)  # the token id of every slot of the live KV
        seq.written += sum(min(s.end, seq.prompt_len) - s.start for s in spans if s.start < seq.prompt_len)
        groups: dict[tuple[float | None, bool], list] = {}
        for s in spans:
            groups.setdefault(self._write_policy(req, s.end), []).append(s)
        n = 0
        for (expires_at, memory_only), group in groups.items():
            if self.saver is not None:
                n += self.saver.save(kv, self.codec, group, ids, skip_held, expires_at=expires_at,
                                     memory_only=memory_only)
            else:
                todo = executor.unheld(self.store, group) if skip_held else group
                n += executor.store(self.store, kv, self.codec, todo, ids, expires_at=expires_at,
                                    memory_only=memory_only)
        return n

    def _retain(self, seq: Sequence, loads) -> None:
        """Entries this request reuses stay at least as long as it asks (a retention duration, a
        breakpoint's ttl): their expiry is extended, never shortened."""
        c = seq.request.cache
        retention = c.retention or self.retention
        if not loads or (retention is None and not c.breakpoints):
            return
        now = self.store.tiers[0].clock()
        groups: dict[float, list[ChunkKey]] = {}
        for x in loads:
            until = keep_until(x.end, retention, c.breakpoints, now)
            if until is not None and x.tier is not None:
                groups.setdefault(until, []).append(x.key)
        for until, keys in groups.items():
            self.store.extend(keys, until)

    def _complete(self, seq: Sequence) -> None:
        req, t = seq.request, seq.timings
        if seq.started:
            t.decode_s = time.perf_counter() - seq.t_decode
            store_generated = req.cache.store_generated if req.cache.store_generated is not None else self.store_generated
            if seq.keys is not None and self.history is not None and self._is_history(req.prompt):
                t0 = time.perf_counter()
                self._keep_history(seq)
                t.store_s += time.perf_counter() - t0
            elif seq.keys is not None and store_generated and req.prompt.is_plain:
                n = seq.prompt_len
                full = req.prompt.ids + seq.token_ids[: seq.kv.length - n]
                spans = generated_stores(full, seq.kv.length, self.chunk_size, seq.namespace, len(seq.keys.prefix))
                seq.stored += self._save(seq, spans)
            self.stats.add(prompt_tokens=seq.prompt_len, tokens_reused=seq.reused,
                           tokens_prefilled=seq.prompt_len - seq.reused, tokens_recomputed=seq.recomputed,
                           blended_requests=int(seq.plan.has_documents),
                           history_requests=int(seq.record is not None),
                           history_tokens_reused=seq.history_reused, moved_tokens_reused=seq.moved_reused,
                           hits_by_tier={tier: seq.hit_tiers.count(tier) for tier in set(seq.hit_tiers)})
        t.total_s = time.perf_counter() - seq.t_start
        self.stats.add(requests=1, tokens_generated=len(seq.token_ids), chunks_stored=seq.stored)
        result = GenerationResult(seq.text, seq.token_ids, seq.finish_reason, seq.prompt_len, seq.reused, t,
                                  seq.hit_tiers, seq.stored, seq.recomputed, seq.stream, seq.written, seq.kept)
        self._end(seq, Outcome(result=result))

    def _keep_history(self, seq: Sequence) -> None:
        """The turn is over: remember the ids its KV holds (the prompt and the answer tokens fed
        back) and save the entries the prompt's own chunks do not cover, the partial last chunk
        as a tail, off the request path."""
        req, n, ch = seq.request, seq.prompt_len, self.chunk_size
        state = req.prompt.ids + seq.token_ids[: seq.kv.length - n]
        entries = history_entries(state, ch, seq.namespace)
        new = [Store(e.key, e.source, e.source + e.tokens) for e in entries
               if e.source + e.tokens > len(seq.keys.prefix) * ch]
        kept = self.history.add(seq.scope, state, seq.namespace, tuple(entries), req.cache.history_key,
                                replaces=seq.record)
        seq.kept = kept or Record(seq.scope, np.asarray(state, dtype=np.uint32), seq.namespace, tuple(entries),
                                  req.cache.history_key)
        seq.stored += self._save(seq, new, skip_held=True)

    def _skip(self, seq: Sequence, why: str) -> None:
        self.stats.add(requests=1, requests_skipped=1)
        self._end(seq, Outcome(error=RequestCancelled(why)))

    def _done_computing(self, seq: Sequence) -> None:
        """``seq``'s new chunks are stored (or never will be): deferred prompts may load them."""
        if seq.computing:
            self._computing -= seq.computing
            seq.computing = set()

    def _end(self, seq: Sequence, outcome: Outcome) -> None:
        self._done_computing(seq)
        self.scheduler.finish(seq)
        if outcome.error is not None and seq.kv is not None:
            # A failed request's KV is dropped now, whatever still refers to it (an exception's
            # frames, a log record); its saves, if any were queued, are lost with it.
            seq.kv.release()
        seq.kv = None  # the live KV is freed as soon as the request is done (once the saver copied it)
        with self._active_lock:
            self._active.pop(seq.request, None)
        seq.request.finish(outcome)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Run steps on a loop thread of the engine's own (what a server does)."""
        if self._loop is None or not self._loop.is_alive():
            self._loop = EngineLoop(self)
            self._loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, cancel the waiting ones and the running ones, stop the loop."""
        for seq in self.scheduler.close():
            seq.request.cancel.set()
            self._skip(seq, "the engine is shutting down")
        for seq in self.scheduler.running():
            seq.request.cancel.set()
        self.scheduler.wake()
        if self._loop is not None:
            self._loop.join(timeout)
            if self._loop.is_alive():
                log.warning("the engine loop did not stop within %.0f s", timeout)

    def close(self) -> None:
        """``stop()``, then flush and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.saver is not None:
            self.saver.close()  # saves what is queued first
        if self.store is not None:
            self.store.close()  # flushes the queued writes to disk / Redis

    # ------------------------------------------------------------------------------ the server's view

    @property
    def cache_enabled(self) -> bool:
        return self.store is not None

    def stats_snapshot(self) -> dict:
        """The engine's counters (a consistent copy), with the histories remembered and the
        saver's counters (``saver``: saves, their time off the request path, waits) when on."""
        out = self.stats.snapshot()
        if self.history is not None:
            out["history_records"] = len(self.history)
        if self.saver is not None:
            out["saver"] = {**self.saver.stats.snapshot(), "pending": self.saver.pending()}
        return out

    def cache_stats(self) -> dict[str, dict]:
        """Counters of every tier and of the store ({} without a cache)."""
        return self.store.stats() if self.store is not None else {}

    def queue_state(self) -> dict[str, int]:
        b = self.kv_budget
        return {"waiting": len(self.scheduler), "running": len(self.scheduler.running()),
                "max_queue": self.scheduler.max_waiting, "skipped": self.scheduler.skipped,
                "max_running": self.scheduler.max_running, "preempted": self.scheduler.preempted,
                "kv_bytes_used": b.used, "kv_bytes_peak": b.peak, "kv_bytes_limit": b.limit or 0}

    def clear_cache(self, tenant: str, salt: str | None = None) -> dict[str, int]:
        """Delete ``tenant``'s entries from every tier: all of them, or only namespace ``salt``."""
        if self.store is None:
            return {}
        prefix = tenant_tag(tenant) if salt is None else self.namespace(tenant, salt).key_prefix()
        self.flush()
        if self.history is not None:
            self.history.delete_prefix(prefix)
        return self.store.delete_prefix(prefix)

    def free_entries(self, keys: Seq[str]) -> dict[str, int]:
        """Remove the entries ``keys`` (their string forms; e.g. a deleted response's) from every
        tier, after the saves still queued for them; entries removed per tier."""
        if self.store is None or not keys:
            return {}
        parsed = []
        for k in keys:
            try:
                parsed.append(ChunkKey.parse(k))
            except ValueError:
                log.warning("not a chunk key, not freed: %r", k)
        if self.saver is not None:
            self.saver.wait(parsed)
        return self.store.delete(parsed)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the saver's queued saves and the store's queued lower-tier writes; False if
        ``timeout`` passed first."""
        if self.store is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.saver is not None and not self.saver.flush(timeout):
            return False
        return self.store.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
