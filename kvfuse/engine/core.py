"""The engine: requests in, a step at a time (schedule -> run -> post-process), results out.

``submit`` queues a request (its prompt checked and its keys computed on the caller's thread);
``step`` runs one engine step: the scheduler picks the work, the engine prefills the admitted
sequence (lookup -> plan -> fetch -> replan around unusable entries -> precompute -> load and
compute in slot order -> first token -> store) or decodes one token of the running ones, and
post-processing accepts the sampled tokens, streams their text and finishes sequences (stop,
length, cancel; the answer's chunks stored when asked). ``generate`` is submit + steps until that
request is done, on the caller's thread or, after ``start()``, on the engine's own loop thread.

Greedy output with a cache hit is token-for-token the output without one: the live KV has the
stored dtype, so a loaded chunk holds exactly what a prefill writes, and moved keys are rotated
exactly (``rope``). The server reads statistics and clears tenants only through the narrow API at
the end of this class (``stats_snapshot``, ``cache_stats``, ``clear_cache``, ``queue_state``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence as Seq

import torch

from kvfuse.blend import BlendOptions, LayerLoadFailed
from kvfuse.codecs import get_codec
from kvfuse.generation import Sampler, SamplingParams, StopMatcher
from kvfuse.kv.keys import ChunkKey, Namespace, document_key, layout_of, tenant_tag
from kvfuse.models import LoadedModel
from kvfuse.models.tokenizer import StreamDecoder
from kvfuse.tiers.store import TieredStore

from . import encode, executor
from .loop import EngineLoop
from .planner import Precompute, full_prefill, generated_stores, prompt_keys, replan
from .prompt import Prompt
from .request import CacheOptions, GenerationResult, Outcome, Request, RequestCancelled, Timings
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import EngineStats

log = logging.getLogger(__name__)

KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        self.model = model
        self.store = store
        self.chunk_size = chunk_size
        self.kv_dtype_name = kv_dtype
        self.kv_dtype = KV_DTYPES[kv_dtype]
        self.codec = get_codec(codec, codec_level)  # how this engine writes entries; any codec is read
        self.store_generated = store_generated
        self.base_salt = salt
        self.blend = blend
        if blend.check_layer >= model.config.num_layers:
            raise ValueError(f"blend check_layer {blend.check_layer} is not a layer of this model "
                             f"({model.config.num_layers} layers)")
        self.stats = EngineStats()
        self.scheduler = Scheduler(max_waiting)
        self._active: dict[Request, Sequence] = {}
        self._active_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._loop: EngineLoop | None = None
        self._closed = False
        c = model.config
        self._layout = layout_of(c.num_layers, c.num_kv_heads, c.head_dim)
        if store is not None:
            store.set_lookahead(self.scheduler.upcoming_keys)

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

    def document_context(self, blend: BlendOptions | None = None) -> tuple[int, ...]:
        """What documents' KV is computed behind when cached on their own (``document_context``)."""
        bos = self.model.tokenizer.bos_token_id
        return (bos,) if (blend or self.blend).document_context == "bos" and bos is not None else ()

    def check(self, prompt: Prompt, params: SamplingParams) -> None:
        """ValueError when prompt + max_tokens exceeds the model's context window."""
        limit = self.model.config.max_position_embeddings
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

    def _sequence(self, request: Request) -> Sequence:
        """A request's sequence, with its keys computed (hashing only)."""
        blend = request.blend or self.blend
        ns, keys = None, None
        if self.store is not None and request.cache.enabled:
            c = request.cache
            ns = self.namespace(c.tenant, c.salt)
            blend_ns = self.namespace(c.tenant, c.salt, blend) if blend.store_blended else None
            keys = prompt_keys(request.prompt, self.chunk_size, ns, self.document_context(blend), blend_ns,
                               chain_over_suffix=blend.query_aware)
        return Sequence(request, ns, keys, blend)

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
                self.store.put([(key, entry)])
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
            self._prefill(seq)
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
        """One engine step: schedule, run, post-process. Returns the requests it finished."""
        with self._step_lock:
            scheduled = self.scheduler.schedule()
            finished: list[Sequence] = []
            for seq in scheduled.skipped:
                self._skip(seq, "the client left while the request was queued")
                finished.append(seq)
            ran = []
            if scheduled.prefill is not None and self._guard(scheduled.prefill, self._prefill):
                ran.append(scheduled.prefill)
            ran += [seq for seq in scheduled.decode if self._guard(seq, self._decode)]
            for seq in ran:
                if seq.finish_reason is None:
                    seq.accept_pending()
                if seq.finish_reason is not None:
                    self._guard(seq, self._complete)
                    finished.append(seq)
            return [s.request for s in finished]

    def _guard(self, seq: Sequence, fn: Callable[[Sequence], None]) -> bool:
        """Run one part of a step for ``seq``; an exception ends that request, not the engine."""
        try:
            fn(seq)
            return True
        except Exception as e:
            if not isinstance(e, ValueError):
                log.exception("request %s failed in the engine", seq.request.request_id)
            self._end(seq, Outcome(error=e))
            return False

    def _prefill(self, seq: Sequence) -> None:
        seq.start_clock()
        req, t = seq.request, seq.timings
        prompt, runner = req.prompt, self.model.runner
        unusable: set[ChunkKey] = set()
        where = None
        for _ in range(4):  # a document unreadable mid-blend: plan around it and start again
            entries: dict = {}
            served: dict[ChunkKey, str] = {}
            if seq.keys is None:
                plan = full_prefill(prompt)
            else:
                t0 = time.perf_counter()
                if where is None:
                    where = self.store.lookup(seq.keys.all()).where
                    t.lookup_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                plan = replan(prompt, seq.keys, where, unusable)
                fetched = executor.fetch(self.store, runner, self.kv_dtype, plan, pipelined=plan.has_documents)
                if fetched.unusable:
                    unusable |= fetched.unusable
                    plan = replan(prompt, seq.keys, where, unusable)
                t.load_s += time.perf_counter() - t0
                entries, served = fetched.entries, fetched.served
                self.stats.add(chunk_load_failures=fetched.rejected)
            seq.plan = plan
            if req.cancel.is_set():  # e.g. the client left just as the request was admitted
                seq.finish_reason = "cancelled"
                return
            for pre in plan.precomputes:
                if pre.key not in entries:
                    entries[pre.key] = executor.precompute(runner, self.kv_dtype, self.codec, pre)
                    self.store.put([(pre.key, entries[pre.key])])
                    seq.stored += 1
            seq.kv = runner.new_cache(len(prompt) + req.params.max_tokens, dtype=self.kv_dtype)
            if not plan.has_documents:
                filled = executor.prefill(runner, seq.kv, prompt.ids, plan, entries)
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
        from_store = [x for x in plan.loads if x.tier is not None]
        seq.hit_tiers = tuple(served[x.key] for x in from_store)
        seq.reused, seq.started = plan.reused_tokens, True
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
        if plan.stores:
            seq.stored += executor.store(self.store, seq.kv, self.codec, plan.stores)
        t.store_s = time.perf_counter() - t0
        p = req.params
        seq.eos = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.model.eos_token_ids))
        seq.decoder, seq.stops = StreamDecoder(self.model.tokenizer), StopMatcher(p.stop)
        seq.t_decode = time.perf_counter()

    def _decode(self, seq: Sequence) -> None:
        seq.pending = seq.sampler(self.model.runner.forward([seq.token_ids[-1]], seq.kv))

    def _complete(self, seq: Sequence) -> None:
        req, t = seq.request, seq.timings
        if seq.started:
            t.decode_s = time.perf_counter() - seq.t_decode
            store_generated = req.cache.store_generated if req.cache.store_generated is not None else self.store_generated
            if seq.keys is not None and store_generated and req.prompt.is_plain:
                n = seq.prompt_len
                full = req.prompt.ids + seq.token_ids[: seq.kv.length - n]
                spans = generated_stores(full, seq.kv.length, self.chunk_size, seq.namespace, len(seq.keys.prefix))
                seq.stored += executor.store(self.store, seq.kv, self.codec, spans)
            self.stats.add(prompt_tokens=seq.prompt_len, tokens_reused=seq.reused,
                           tokens_prefilled=seq.prompt_len - seq.reused, tokens_recomputed=seq.recomputed,
                           blended_requests=int(seq.plan.has_documents),
                           hits_by_tier={tier: seq.hit_tiers.count(tier) for tier in set(seq.hit_tiers)})
        t.total_s = time.perf_counter() - seq.t_start
        self.stats.add(requests=1, tokens_generated=len(seq.token_ids), chunks_stored=seq.stored)
        result = GenerationResult(seq.text, seq.token_ids, seq.finish_reason, seq.prompt_len, seq.reused, t,
                                  seq.hit_tiers, seq.stored, seq.recomputed)
        self._end(seq, Outcome(result=result))

    def _skip(self, seq: Sequence, why: str) -> None:
        self.stats.add(requests=1, requests_skipped=1)
        self._end(seq, Outcome(error=RequestCancelled(why)))

    def _end(self, seq: Sequence, outcome: Outcome) -> None:
        self.scheduler.finish(seq)
        seq.kv = None  # the live KV is freed as soon as the request is done
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
        if self.store is not None:
            self.store.close()  # flushes the queued writes to disk / Redis

    # ------------------------------------------------------------------------------ the server's view

    @property
    def cache_enabled(self) -> bool:
        return self.store is not None

    def stats_snapshot(self) -> dict:
        """The engine's counters (a consistent copy)."""
        return self.stats.snapshot()

    def cache_stats(self) -> dict[str, dict]:
        """Counters of every tier and of the store ({} without a cache)."""
        return self.store.stats() if self.store is not None else {}

    def queue_state(self) -> dict[str, int]:
        return {"waiting": len(self.scheduler), "running": len(self.scheduler.running()),
                "max_queue": self.scheduler.max_waiting, "skipped": self.scheduler.skipped}

    def clear_cache(self, tenant: str, salt: str | None = None) -> dict[str, int]:
        """Delete ``tenant``'s entries from every tier: all of them, or only namespace ``salt``."""
        if self.store is None:
            return {}
        prefix = tenant_tag(tenant) if salt is None else self.namespace(tenant, salt).key_prefix()
        return self.store.delete_prefix(prefix)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the store's queued lower-tier writes; False if ``timeout`` passed first."""
        return self.store.flush(timeout) if self.store is not None else True
