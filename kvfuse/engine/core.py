"""The engine: requests in, one step at a time (schedule -> run -> post-process), results out.

``submit`` checks a request, has the cache engine key it (``reuse.CacheEngine.key``, on the
caller's thread) and queues its ``Sequence``. In ``step``, the ``Scheduler`` says which sequences
end, start and run; a newly admitted sequence is handed to the cache engine, which plans and
loads its prompt off the step while the others keep decoding, and joins the batch once that is
done (``_take_loaded``); the model runs one batched pass over the running sequences (preempting
when KV memory is short); post-processing accepts tokens, streams their text and finishes
sequences, their KV handed back to the cache engine. ``generate`` is submit + steps until that
request is done, on the caller's thread or on the engine's loop thread (``start``).

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
from dataclasses import replace

import torch

from kvfuse import dtypes
from kvfuse.blend import BlendOptions
from kvfuse.config import EngineSettings
from kvfuse.generation import SamplingParams
from kvfuse.heap import IdleRelease
from kvfuse.models import LoadedModel
from kvfuse.prompts import Prompt, PromptBuilder
from kvfuse.reuse import CacheOptions, Loaded, open_cache
from kvfuse.store import TieredStore
from kvfuse.threads import hand_over, take_back, use_compute_threads

from . import at_exit, choices
from .kv_memory import KVMemory, initial_slots
from .loop import EngineLoop, Progress
from .prompt_logprobs import prompt_logprobs
from .request import Delta, GenerationResult, Outcome, Request, RequestCancelled
from .scheduler import Batch, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

log = logging.getLogger(__name__)

# How long a step with nothing to run waits for a load to finish (woken early when one does).
LOAD_WAIT_S = 0.05
LEFT_WHILE_QUEUED = "the client left while the request was queued"


class Engine:
    """Generation over one model with an optional tiered KV store; ``settings`` come from the
    configuration (``Config.engine_settings()``), validated there; ``prompts``: the builder the
    server and CLI build prompts with (one is made for the model when not given)."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None = None,
        settings: EngineSettings = EngineSettings(),
        prompts: PromptBuilder | None = None,
    ):
        s, c = settings, settings.cache
        self.model, self.settings = model, settings
        self.kv_dtype = dtypes.torch_dtype(c.kv_dtype)
        self.stats = EngineStats()
        truncate = c.truncation != "off"
        self.prompts = prompts or PromptBuilder.for_model(model, s.context_tokens, truncate)
        self.context_window = self.prompts.context_window
        self.step_lock = threading.Lock()  # held while a step runs: work between steps holds it too
        self.cache = open_cache(model, store, s, self.context_window, self.step_lock)
        check_layer = self.cache.blend.check_layer
        if check_layer >= model.config.num_layers:  # the model's to know, not the config's
            raise ValueError(
                f"blend check_layer {check_layer} is not a layer of this model "
                f"({model.config.num_layers} layers)"
            )
        memory = KVMemory(model.runner, self.kv_dtype, s.engine.kv_memory_bytes, self.cache)
        e = s.engine
        self.scheduler = Scheduler(
            s.max_queue,
            e.max_running,
            memory,
            e.max_step_tokens,
            self.cache.computing,
            e.max_prefill_tokens,
        )
        self.cache.watch(self.scheduler.upcoming_keys, self.scheduler.wake)
        self._loop: EngineLoop | None = None
        self._handed: tuple[int, int] | None = None  # (thread, its count): who started the loop
        self._closed = False
        self._forked: list[Sequence] = []  # choices forked in this step that run now
        self.progress = Progress()
        self.heap = IdleRelease(e.release_idle_s)  # gives freed buffers back when idle
        at_exit.register(self)  # closed at interpreter exit if the caller has not (``at_exit``)

    def namespace(self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None):
        """The cache namespace of ``tenant`` and ``salt`` (``Keying.namespace``)."""
        return self.cache.namespace(tenant, salt, blend)

    # ------------------------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """ValueError for a request that cannot run: beyond the context window or the whole KV
        budget, a blend check layer the model lacks, documents to blend without a cache."""
        self.prompts.check(request.prompt, request.params.max_tokens)
        self.cache.check(request.prompt, request.cache, self._blend(request))
        self.scheduler.memory.check(len(request.prompt), request.params.max_tokens)

    def _blend(self, request: Request) -> BlendOptions | None:
        """The request's blend options: its own (None: the engine's) with its recompute budget."""
        if request.recompute_ratio is None:
            return request.blend
        return (request.blend or self.cache.blend).with_ratio(request.recompute_ratio)

    def submit(self, request: Request) -> None:
        """Queue ``request``. ValueError for a prompt that cannot run; QueueFull / QueueClosed."""
        self.check(request)
        r = self.cache.key(
            request.prompt,
            request.cache,
            self._blend(request),
            request.params.max_tokens,
            request.request_id,
            request.cancel,
        )
        if r.prompt is not request.prompt:  # lined up with a history: it may be longer now
            self.scheduler.memory.check(len(r.prompt), request.params.max_tokens)
        request.prompt, request.blend = r.prompt, r.blend  # as it runs
        self.scheduler.add(Sequence(request, r))

    def withdraw(self, request: Request) -> None:
        """The client of ``request`` left: drop it if it waits, stop it at its next step if it runs."""
        request.cancel.set()
        for seq in self.scheduler.remove(request):
            self._skip(seq, LEFT_WHILE_QUEUED)
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
        recompute_ratio: float | str | None = None,
    ) -> GenerationResult:
        """Generate from ``prompt`` (token ids or a ``Prompt``) and wait for the result;
        ``on_text`` receives text pieces as they are decoded. ``cancel`` is checked between steps
        (finish reason "cancelled"). ``recompute_ratio``: a budget over ``blend`` (None: the
        engine's). ValueError for an empty prompt or one beyond the context window."""
        prompt = as_prompt(prompt)
        done, outcome = threading.Event(), []
        request = Request(
            prompt,
            params,
            cache,
            blend=blend,
            recompute_ratio=recompute_ratio,
            on_text=on_text,
            on_done=lambda o: (outcome.append(o), done.set()),
            cancel=cancel if cancel is not None else threading.Event(),
        )
        self.submit(request)
        if self._loop is None or not self._loop.is_alive():
            use_compute_threads()  # the steps run on this thread
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
        """Compute and store the KV of each document not cached yet (``reuse.offline``)."""
        if not self.cache.enabled:
            raise ValueError(
                "precompute needs the KV cache, and it is disabled in this configuration"
            )
        docs = []
        for i, text in enumerate(texts):
            try:
                docs.append(self.prompts.encode_document(text))
            except ValueError as e:
                raise ValueError(f"document {i}: {e}") from None
        # ``document_context: prefix``: behind what a chat turn without a system message starts
        # with (a completion's special tokens for a model without a chat template)
        context = (blend or self.cache.blend).document_context
        prefix = self.prompts.default_document_prefix() if context == "prefix" else None
        return self.cache.precompute_documents(docs, cache, blend, prefix, on_document)

    def score(
        self,
        prompt: Seq[int] | Prompt,
        continuations: Seq[Seq[int]] = (),
        *,
        cache: CacheOptions = CacheOptions(),
        blend: BlendOptions | None = None,
    ) -> list[torch.Tensor]:
        """For each continuation, a ``(len + 1, vocab)`` tensor of the logits predicting its
        tokens and the one after (the first row predicts its first token), after ``prompt``
        prefilled exactly as a request would be (lookup, plan, loads, blend): what the quality
        benchmarks compare lossy reuse with. Without continuations, the prompt's last logits.
        Nothing is generated and the answers are not stored (the prompt's new chunks are, as a
        request's would be)."""
        prompt = as_prompt(prompt)
        longest = max((len(c) for c in continuations), default=0)
        request = Request(prompt, SamplingParams(max_tokens=1 + longest), cache, blend=blend)
        self.check(request)
        r = self.cache.key(prompt, cache, blend, 1 + longest, request.request_id)
        with self.step_lock:
            kv = self.model.runner.new_cache(
                initial_slots(r.prompt_len, 0, 1 + longest), dtype=self.kv_dtype
            )
            logits = self.cache.load_now(r, kv).logits
            self.cache.prefilled(r, kv, r.prompt.ids)
            out = []
            for cont in continuations:
                kv.truncate(r.prompt_len)
                rows = [logits[None]]
                if len(cont):
                    more = self.model.runner.forward(list(cont), kv, logits="all")
                    rows.append(more.to(logits.dtype))
                out.append(torch.cat(rows))
        return out if continuations else [logits[None]]

    # ------------------------------------------------------------------------------ steps

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One engine step: schedule, run, post-process. Returns the requests it finished."""
        with self.step_lock:
            scheduled = self.scheduler.schedule()
            finished = [self._skip(s, LEFT_WHILE_QUEUED) for s in scheduled.skipped]
            finished += [self._fail(s, e) for s, e in scheduled.refused]
            self._begin(scheduled.admitted, scheduled.running)
            finished += self._take_loaded()
            running = [s for s in scheduled.running if s.status is SequenceStatus.RUNNING]
            batch = self.scheduler.batch([s for s in running if s.finish_reason is None])
            finished += [self._fail(s, e) for s, e in batch.failed]
            self.stats.add(preemptions=len(batch.preempted))
            ran = bool(batch.items)
            if ran:
                self._run(batch)
            batch = None  # nothing of this step may hold a finished sequence's KV
            forked, self._forked = self._forked, []
            finished += self._post_process(running + forked)
            if ran or finished or scheduled.admitted:
                self.progress.advanced()
        if not ran and not finished and self.cache.loading():
            self.scheduler.pause(LOAD_WAIT_S)  # only loads in flight: wait for one (or a submit)
        return [s.request for s in finished]

    def _begin(self, admitted: list[Sequence], running: list[Sequence]) -> None:
        """Admitted sequences: the cache engine plans and loads them off the step. When no other
        sequence has anything to compute meanwhile, the step waits for those loads."""
        for seq in admitted:
            seq.start_clock()
            seq.loading = True
            self.cache.begin(seq.reuse, seq.kv, seq)
        if admitted and all(s.loading or s.finish_reason is not None for s in running):
            self.cache.wait_loads()

    def _take_loaded(self) -> list[Sequence]:
        """The sequences the cache engine finished loading: what needs the model is loaded now,
        then they join the batch (a fully cached prompt samples its first token at once). Those
        whose load failed are finished and returned."""
        failed = []
        for done in self.cache.ready():
            seq = done.tag
            seq.loading = False
            if done.error is not None:
                self._end(seq, Outcome(error=done.error))
                failed.append(seq)
            elif not self._guard(seq, lambda s, d=done: self._loaded(s, d)):
                failed.append(seq)
        return failed

    def _loaded(self, seq: Sequence, done: Loaded) -> None:
        filled = self.cache.load(seq.reuse, seq.kv, done.ready)
        if filled is None:  # the client left as the request was admitted
            seq.cancel()
            return
        seq.loaded(filled)
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
            if seq.status is not SequenceStatus.RUNNING or seq.loading:
                continue  # preempted in this step, or still loading
            if seq.decode.pending is not None and seq.finish_reason is None:
                seq.accept_pending()
            elif seq.prefill.fill and seq.request.cancel.is_set():
                seq.cancel()
            if seq.finish_reason is not None:
                self._guard(seq, self._complete)
                finished.append(seq)
        return finished

    def _first_token(self, seq: Sequence) -> None:
        """The prompt's KV is complete and its last token's logits are in: the prompt's logprobs
        if asked, sample the first token, count what was reused, write the new chunks, fork the
        other choices (``n > 1``). A preempted sequence (or a forked choice) admitted again only
        samples its next token (all of that happened the first time)."""
        if seq.started:
            return seq.decode.sample(seq.prefill.logits)
        top = seq.request.params.prompt_logprobs
        if top is not None:
            ids = seq.reuse.prompt.ids
            seq.prompt_logprobs = prompt_logprobs(self.model.runner, seq.kv, ids, top)
            if seq.request.on_delta is not None:
                seq.request.on_delta(Delta(0, prompt_logprobs=tuple(seq.prompt_logprobs)))
        seq.start_decoding(self.model.tokenizer, self.model.eos_token_ids)  # the first token
        t0 = time.perf_counter()
        self.cache.prefilled(seq.reuse, seq.kv, seq.reuse.prompt.ids + seq.token_ids)
        seq.timings.store_s = time.perf_counter() - t0
        seq.decode.started_at = time.perf_counter()
        if seq.request.on_start is not None:  # what the prompt reused and wrote, before any text
            now = seq.result()  # a snapshot: the sequence keeps updating its tokens and timings
            seq.request.started(
                replace(now, token_ids=list(now.token_ids), timings=replace(now.timings))
            )
        if seq.request.params.n > 1:
            self._fork(seq)

    def _fork(self, parent: Sequence) -> None:
        """The other choices of ``parent``'s request (``choices``): each runs on a copy of the
        prompt's KV and samples its first token from the prompt's logits now, or, when the copy
        or a running place is not to be had, waits in the queue (and recomputes the prompt)."""
        children = choices.fork(parent, self.model.tokenizer, self.model.eos_token_ids)
        queued = []
        for child in children:
            if queued or not self.scheduler.memory.fork(parent, child):
                queued.append(child)
            elif not self.scheduler.adopt(child):
                child.kv.release()
                child.kv = None
                queued.append(child)
            else:
                child.decode.sample(parent.prefill.logits)
                self._forked.append(child)
        self.stats.add(choices_forked=len(children) - len(queued), choices_queued=len(queued))
        if queued:
            self.scheduler.requeue(queued)

    def _complete(self, seq: Sequence) -> None:
        """``seq`` finished: its KV handed back to the cache engine, counted, its result out."""
        t = seq.timings
        t0 = time.perf_counter()
        if seq.started:
            t.decode_s = t0 - seq.decode.started_at
        if seq.choice == 0:  # the prompt's reuse, history and counters are the parent's
            self.cache.finish(seq.reuse, seq.kv if seq.started else None, seq.token_ids)
        t.store_s += time.perf_counter() - t0
        t.total_s = time.perf_counter() - seq.t_start
        self.stats.add(**seq.counters())
        self._end(seq, Outcome(result=seq.result()))

    def _skip(self, seq: Sequence, why: str) -> Sequence:
        first = int(seq.choice == 0)  # a request counts once, whatever its choices
        self.stats.add(requests=first, requests_skipped=first)
        self._end(seq, Outcome(error=RequestCancelled(why)))
        return seq

    def _fail(self, seq: Sequence, error: Exception) -> Sequence:
        """``seq`` failed before it could run, at admission or as its cache grew: it can never
        fit the KV budget (a ValueError, a 400 at the server), or its cache could not be
        allocated (e.g. the device is out of memory). It ends with that error instead of blocking
        admission, or every step, for everything behind it."""
        log.warning("request %s failed: %s", seq.request.request_id, error)
        self.stats.add(requests=1)
        self._end(seq, Outcome(error=error))
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
        family = seq.family
        if family is None or outcome.error is not None:
            seq.request.finish(outcome)
            if family is not None:  # the first error ends the request: its other choices stop
                seq.request.cancel.set()
        elif (result := family.done(seq)) is not None:
            seq.request.finish(Outcome(result=result))

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

    def idle_work(self) -> bool:
        """Background work for when nothing waits or runs (the loop calls it): one check of the
        online blend guard, else the heap given back once idle long enough (``kvfuse.heap``);
        whether there is more to do at once."""
        return self.cache.verify_one(self.score) or self.heap(self.progress.steps)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Run steps on a loop thread of the engine's own (what a server does). The calling thread
        gives its OpenMP team back and computes serially until ``stop`` is called from it
        (``kvfuse.threads``)."""
        if self._loop is None or not self._loop.is_alive():
            self._loop = EngineLoop(self.step, self.scheduler, self.idle_work, self.progress)
            self._loop.start()
            self._handed = (threading.get_ident(), hand_over())

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
        if self._handed is not None and self._handed[0] == threading.get_ident():
            take_back(self._handed[1])  # the thread that started the loop computes again
            self._handed = None

    def close(self, flush_timeout: float | None = None) -> bool:
        """``stop()``, then the cache engine's saves and lower-tier writes flushed (within
        ``flush_timeout``; None: as long as they take), and only then its threads stopped and its
        store closed. False when the flush did not end in time. Idempotent."""
        if self._closed:
            return True
        self._closed = True
        at_exit.unregister(self)
        self.stop()
        return self.cache.close(flush_timeout)

    # ------------------------------------------------------------------------------ the server's view

    @property
    def cache_enabled(self) -> bool:
        return self.cache.enabled

    def stats_snapshot(self) -> dict:
        """The serving loop's, the prompt builder's and the cache engine's counters (a
        consistent copy of each): requests and steps, truncations, reuse, histories remembered
        and the saver's figures (``saver``) when it runs."""
        return {**self.stats.snapshot(), **self.prompts.stats.snapshot(), **self.cache.counters()}

    def cache_stats(self) -> dict[str, dict]:
        """Counters of every tier and of the store ({} without a cache)."""
        return self.cache.tier_stats()

    def tenant_usage(self) -> dict:
        """Per tier, per tenant tag: bytes and entries held, quota, evictions ({} without one)."""
        return self.cache.tenant_usage()

    def queue_state(self) -> dict[str, int]:
        return self.scheduler.state()

    def health(self, stall_after_s: float) -> dict:
        """The loop's progress (``Progress.report``): ``wedged`` when work waits and no step
        did anything for ``stall_after_s``, or the loop thread died while the engine runs."""
        loop_dead = self._loop is not None and not self._loop.is_alive() and not self._closed
        return self.progress.report(self.has_work(), stall_after_s, loop_dead)

    def clear_cache(self, tenant: str, salt: str | None = None, timeout: float | None = None):
        """Delete ``tenant``'s entries (and history records) from every tier: all of them, or those
        of every namespace derived from ``salt``; a ``Cleared`` (entries removed per tier, and
        whether the queued writes were waited for: at most ``timeout``)."""
        return self.cache.clear(tenant, salt, timeout)

    def free_entries(self, keys: Seq[str], timeout: float | None = None) -> dict[str, int]:
        """Remove the entries ``keys`` (their string forms; e.g. a deleted response's) from every
        tier, after the saves still queued for them (the store's queued writes waited for at most
        ``timeout``); entries removed per tier."""
        return self.cache.free(keys, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued saves and lower-tier writes; False if ``timeout`` passed first."""
        return self.cache.flush(timeout)


def as_prompt(prompt: Seq[int] | Prompt) -> Prompt:
    """A ``Prompt`` of token ids as they are; ValueError for an empty one."""
    if isinstance(prompt, Prompt):
        return prompt
    if not list(prompt):
        raise ValueError("the prompt is empty")
    return Prompt.plain(list(prompt))
