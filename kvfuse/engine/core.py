"""The engine: requests in, one step at a time (schedule -> run -> post-process), results out.

``submit`` checks a request and queues its ``Sequence`` (keys computed on the caller's thread by
``keying``). In ``step``, the ``Scheduler`` says which sequences end, start and run, and, once the
new ones are planned and loaded (``prefill``), which tokens the forward pass computes (preempting
when KV memory is short); the model runs one batched pass; post-processing accepts tokens, streams
their text and finishes sequences, their KV handed to the ``CacheWriter``. ``generate`` is submit +
steps until that request is done, on the caller's thread or on the engine's loop thread (``start``).

A loaded chunk holds exactly what a prefill of its tokens writes (the live KV has the stored
dtype) and moved keys are rotated exactly (``rope``), so greedy output with a cache hit is the
output without one up to float rounding: computing a prompt in two parts (the cached one, then
the rest) sums in another order than computing it whole, which can flip a near-tie. The server
reads statistics and clears tenants only through the narrow API at the end of this class.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kvfuse import dtypes
from kvfuse.blend import BlendOptions
from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.generation import SamplingParams
from kvfuse.history import HistoryIndex
from kvfuse.kv.keys import tenant_tag
from kvfuse.models import LoadedModel
from kvfuse.store import TieredStore
from kvfuse.store.prefetch import Prefetcher

from . import offline
from .cache_writer import CacheWriter
from .keying import Keying
from .kv_memory import KVMemory
from .kv_stream import LoadEstimates
from .loop import EngineLoop
from .prefill import Prefiller
from .prompt import Prompt
from .prompt_builder import PromptBuilder
from .request import CacheOptions, GenerationResult, Outcome, Request, RequestCancelled
from .retention import Retention
from .saver import Saver
from .scheduler import Batch, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

log = logging.getLogger(__name__)


class Engine:
    """Generation over one model with an optional tiered KV store; ``settings`` come from the
    configuration (``Config.engine_settings()``), validated there."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None = None,
        settings: EngineSettings = EngineSettings(),
    ):
        s, c = settings, settings.cache
        self.model, self.store, self.settings = model, store, settings
        self.kv_dtype = dtypes.torch_dtype(c.kv_dtype)
        self.stats, self.estimates = EngineStats(), LoadEstimates()
        self.context_window = min(model.config.max_position_embeddings, s.context_tokens or 1 << 62)
        self.prompts = PromptBuilder(model, self.context_window, c.truncation != "off", self.stats)
        # Conversations: the ids each stored history was built from (found again for a later turn),
        # its KV saved off the request path, queued requests' KV prefetched and kept in memory.
        history = (
            HistoryIndex(c.history_records, s.history_path)
            if store is not None and c.history
            else None
        )
        self.saver = Saver(store) if store is not None and c.async_save else None
        retention = Retention.parse(c.retention) if c.retention is not None else None
        self.keying = Keying(
            model, store, self.saver, s, history, self.context_window
        )  # its profile: codec level too
        self.codec = get_codec(c.codec, c.codec_level).for_model(
            model.config.layer_types, self.keying.codec_level
        )
        self.writer = (
            CacheWriter(
                store, self.saver, self.codec, c.chunk_size, retention, c.store_generated, history
            )
            if store is not None
            else None
        )
        self.blend = self.keying.blend  # ``auto`` resolved against the model's blend profile
        if (
            self.blend.check_layer >= model.config.num_layers
        ):  # depends on the model: not the config's to know
            raise ValueError(
                f"blend check_layer {self.blend.check_layer} is not a layer of this model "
                f"({model.config.num_layers} layers)"
            )
        self.prefiller = Prefiller(
            model,
            store,
            self.saver,
            self.keying,
            self.writer,
            self.kv_dtype,
            self.codec,
            c.kv_slo_ms,
            self.stats,
            self.estimates,
        )
        memory = KVMemory(model.runner, self.kv_dtype, s.engine.kv_memory_bytes, self.saver)
        self.scheduler = Scheduler(
            s.max_queue, s.engine.max_running, memory, s.engine.max_step_tokens
        )
        self.prefetcher = None
        if store is not None:
            store.use_model(model.config.layer_types, self.keying.codec_level)
            store.set_lookahead(self.scheduler.upcoming_keys)
            store.protect_upcoming(c.eviction == "queue")
            if c.prefetch and store.lower:
                self.prefetcher = Prefetcher(store)
        self.step_lock = threading.Lock()  # held while a step runs: work between steps holds it too
        self._loop: EngineLoop | None = None
        self._closed = False

    def namespace(self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None):
        """The cache namespace of ``tenant`` and ``salt`` (``Keying.namespace``)."""
        return self.keying.namespace(tenant, salt, blend)

    # ------------------------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """ValueError for a request that cannot run: beyond the context window or the whole KV
        budget, a blend check layer the model lacks, documents to blend without a cache."""
        self.prompts.check(request.prompt, request.params.max_tokens)
        blend = self.keying.resolve(request.blend)
        if blend.check_layer >= self.model.config.num_layers:
            raise ValueError(f"blend check_layer {blend.check_layer} is not a layer of this model")
        if (
            request.prompt.documents
            and blend.blends
            and (self.store is None or not request.cache.enabled)
        ):
            raise ValueError("documents need the KV cache: it is disabled for this request")
        self.scheduler.memory.check(len(request.prompt), request.params.max_tokens)

    def submit(self, request: Request) -> None:
        """Queue ``request``. ValueError for a prompt that cannot run; QueueFull / QueueClosed."""
        self.check(request)
        self.scheduler.add(self.keying.sequence(request))
        if self.prefetcher is not None:
            self.prefetcher.wake()

    def withdraw(self, request: Request) -> None:
        """The client of ``request`` left: drop it if it waits, stop it at its next step if it runs."""
        request.cancel.set()
        seq = self.scheduler.remove(request)
        if seq is not None:
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
        ``on_text`` receives text pieces as they are decoded. ``cancel`` is checked between steps
        (finish reason "cancelled"). ValueError for an empty prompt or one beyond the context window."""
        if not isinstance(prompt, Prompt):
            if not list(prompt):
                raise ValueError("the prompt is empty")
            prompt = Prompt.plain(list(prompt))
        done, outcome = threading.Event(), []
        request = Request(
            prompt,
            params,
            cache,
            blend=blend,
            on_text=on_text,
            on_done=lambda o: (outcome.append(o), done.set()),
            cancel=cancel if cancel is not None else threading.Event(),
        )
        self.submit(request)
        while not done.is_set():
            if self._loop is not None and self._loop.is_alive():
                done.wait(0.1)
            else:
                self.step()
        if isinstance(outcome[0].error, RequestCancelled):
            return GenerationResult.cancelled(len(prompt))
        if outcome[0].error is not None:
            raise outcome[0].error
        return outcome[0].result

    def precompute_documents(
        self,
        texts: Seq[str],
        cache: CacheOptions = CacheOptions(),
        blend: BlendOptions | None = None,
        on_document: Callable[[int, bool], None] | None = None,
    ) -> dict[str, int]:
        """Compute and store the KV of each document not cached yet (``offline.precompute_documents``)."""
        return offline.precompute_documents(self, texts, cache, blend, on_document)

    def score(
        self,
        prompt: Seq[int] | Prompt,
        continuations: Seq[Seq[int]] = (),
        *,
        cache: CacheOptions = CacheOptions(),
        blend: BlendOptions | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced logits after ``prompt`` prefilled as a request would be (``offline.score``)."""
        return offline.score(self, prompt, continuations, cache, blend)

    # ------------------------------------------------------------------------------ steps

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One engine step: schedule, run, post-process. Returns the requests it finished."""
        with self.step_lock:
            scheduled = self.scheduler.schedule()
            finished = [
                self._skip(seq, "the client left while the request was queued")
                for seq in scheduled.skipped
            ]
            finished += [seq for seq in scheduled.admitted if not self._guard(seq, self.admit)]
            running = [s for s in scheduled.running if s.status is SequenceStatus.RUNNING]
            batch = self.scheduler.batch([s for s in running if s.finish_reason is None])
            self.stats.add(preemptions=len(batch.preempted))
            if batch.items:
                self._run(batch)
            batch = None  # nothing of this step may hold a finished sequence's KV
            finished += self._post_process(running)
            return [s.request for s in finished]

    def admit(self, seq: Sequence, chunked: bool = True) -> None:
        """Plan and load an admitted sequence (``Prefiller.admit``), and sample its first token now
        if nothing is left to compute. On the engine's thread, or under ``step_lock``."""
        self.prefiller.admit(seq, chunked)
        if seq.finish_reason is None:
            self.scheduler.computing.computing(seq)
            if not seq.prefill.fill:
                self._first_token(seq)

    def _run(self, batch: Batch) -> None:
        """The forward pass, then per sequence: a sampled token, or a prompt chunk done (and the
        first token when it was the last chunk). A failure ends the sequences of this pass."""
        t0 = time.perf_counter()
        try:
            logits = self.model.runner.forward_batch(batch.forward_items())
        except Exception as e:
            log.exception("a batched step of %d sequences failed", len(batch.items))
            for seq, _ in batch.items:
                self._end(seq, Outcome(error=e))
            return
        dt = time.perf_counter() - t0
        self.stats.add(**batch.counters())
        for (seq, n), out in zip(batch.items, logits):
            if not seq.prefill.fill:
                self._guard(seq, lambda s: s.decode.sample(out))
            elif seq.prefill.computed(n, out, dt * n / batch.tokens):
                self._guard(seq, self._first_token)

    def _post_process(self, running: list[Sequence]) -> list[Sequence]:
        """Accept the sampled tokens and finish the sequences that are done; those are returned."""
        finished = []
        for seq in running:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted in this step
            if seq.decode.pending is not None and seq.finish_reason is None:
                seq.accept_pending()
            elif seq.prefill.fill and seq.request.cancel.is_set():
                seq.cancel()
            if seq.finish_reason is not None:
                self._guard(seq, self._complete)
                finished.append(seq)
        return finished

    def _first_token(self, seq: Sequence) -> None:
        """The prompt's KV is complete and its last token's logits are in: sample the first token,
        count what was reused, write the new chunks. A preempted sequence admitted again only
        samples its next token (all of that happened the first time)."""
        if seq.started:
            return seq.decode.sample(seq.prefill.filled.logits)
        seq.count_prefill()
        self.prefiller.measure(seq)
        seq.start_decoding(
            self.model.tokenizer, self.model.eos_token_ids
        )  # the first token, the TTFT
        t0 = time.perf_counter()
        if self.writer is not None:
            self.writer.after_prefill(seq)
        self.scheduler.computing.done(seq)
        seq.timings.store_s = time.perf_counter() - t0
        seq.decode.started_at = time.perf_counter()

    def _complete(self, seq: Sequence) -> None:
        """``seq`` finished: its KV written (``CacheWriter.after_turn``), counted, its result out."""
        t = seq.timings
        if seq.started:
            t.decode_s = time.perf_counter() - seq.decode.started_at
            t0 = time.perf_counter()
            if self.writer is not None:
                self.writer.after_turn(seq)
            t.store_s += time.perf_counter() - t0
        t.total_s = time.perf_counter() - seq.t_start
        self.stats.add(**seq.counters())
        self._end(seq, Outcome(result=seq.result()))

    def _skip(self, seq: Sequence, why: str) -> Sequence:
        self.stats.add(requests=1, requests_skipped=1)
        self._end(seq, Outcome(error=RequestCancelled(why)))
        return seq

    def _end(self, seq: Sequence, outcome: Outcome) -> None:
        self.scheduler.finish(seq)
        if outcome.error is not None and seq.kv is not None:
            # A failed request's KV is dropped now, whatever still refers to it (an exception's
            # frames, a log record); its saves, if any were queued, are lost with it.
            seq.kv.release()
        seq.kv = (
            None  # the live KV is freed as soon as the request is done (once the saver copied it)
        )
        seq.request.finish(outcome)

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

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Run steps on a loop thread of the engine's own (what a server does)."""
        if self._loop is None or not self._loop.is_alive():
            self._loop = EngineLoop(self.step, self.scheduler)
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
        if self.writer is not None:
            self.writer.close()  # saves what is queued, then flushes the store's writes and closes it

    # ------------------------------------------------------------------------------ the server's view

    @property
    def cache_enabled(self) -> bool:
        return self.store is not None

    def stats_snapshot(self) -> dict:
        """The engine's counters (a consistent copy), with the histories remembered and the
        saver's counters (``saver``: saves, their time off the request path, waits) when on."""
        return {
            **self.stats.snapshot(),
            **(self.writer.counters() if self.writer is not None else {}),
        }

    def cache_stats(self) -> dict[str, dict]:
        """Counters of every tier and of the store ({} without a cache)."""
        return self.store.stats() if self.store is not None else {}

    def queue_state(self) -> dict[str, int]:
        return self.scheduler.state()

    def clear_cache(self, tenant: str, salt: str | None = None) -> dict[str, int]:
        """Delete ``tenant``'s entries (and history records) from every tier: all of them, or only
        namespace ``salt``; entries removed per tier."""
        if self.writer is None:
            return {}
        return self.writer.clear(
            tenant_tag(tenant) if salt is None else self.namespace(tenant, salt).key_prefix()
        )

    def free_entries(self, keys: Seq[str]) -> dict[str, int]:
        """Remove the entries ``keys`` (their string forms; e.g. a deleted response's) from every
        tier, after the saves still queued for them; entries removed per tier."""
        return self.writer.free(keys) if self.writer is not None and keys else {}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued saves and lower-tier writes; False if ``timeout`` passed first."""
        return self.writer.flush(timeout) if self.writer is not None else True
