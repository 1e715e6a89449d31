"""``CacheEngine``: the cache behind one serving loop, and ``NoCache``, the same face with the
cache off. The serving loop (``kvfuse.engine``) calls one of them at each role of a request and
never asks which it has; the roles and their order are in ``kvfuse/reuse/__init__.py``.

The cache engine is made once per model and store (``Parts``: keying, the saver thread, the
writer, the codec, the KV stream's estimates, the counters), plus the threads that keep the
serving loop's step free of reads and writes: the ``Loader`` (plans and loads admitted
sequences), the saver (copies new KV out and stores it) and, with lower tiers, the prefetcher
(reads queued requests' entries into memory before they run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

from kvfuse import dtypes
from kvfuse.blend import BlendOptions
from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.history import HistoryIndex
from kvfuse.kv.keys import ChunkKey, salt_prefix, tenant_tag
from kvfuse.models import LoadedModel
from kvfuse.models.cache import KVCache
from kvfuse.prompts.prompt import Prompt
from kvfuse.store import TieredStore
from kvfuse.store.prefetch import Prefetcher

from . import offline
from .cache_writer import CacheWriter, Cleared
from .computing import ComputingChunks
from .fetch import FetchedEntries
from .keying import Keying
from .kv_stream import LoadEstimates
from .loader import Loaded, Loader
from .options import CacheOptions
from .parts import Parts
from .plan_executor import Filled, KVSource, execute
from .planner import full_prefill
from .prefill import Prefiller, ReadyPlan
from .retention import Retention
from .saver import Saver, SyncSaver
from .state import Reuse
from .stats import ReuseStats

# The longest a step with nothing else to run waits for loads (a load waits at most ``Saver.wait_s``
# for pending saves, then reads): past it, the step goes on and the loads join a later one.
LOADS_TIMEOUT_S = 30.0


class CacheEngine:
    """The cache of one engine: ``model``'s KV in ``store``, as ``settings`` say."""

    enabled = True

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore,
        settings: EngineSettings,
        context_window: int,
        model_lock: threading.Lock,
    ):
        c = settings.cache
        self.model, self.store, self.model_lock = model, store, model_lock
        history = (
            HistoryIndex(c.history_records, settings.history_path, store.signer)
            if c.history
            else None
        )
        saver = Saver(store, max_jobs=c.save_queue) if c.async_save else SyncSaver(store)
        keying = Keying(model, store, saver, settings, history, context_window)
        codec = get_codec(c.codec, c.codec_level).for_model(
            model.config.layer_types, keying.codec_level, keying.codec_k_cap
        )
        retention = Retention.parse(c.retention) if c.retention is not None else None
        writer = CacheWriter(
            store, saver, codec, c.chunk_size, retention, c.store_generated, history
        )
        self.parts = Parts(
            model.runner,
            store,
            saver,
            keying,
            writer,
            codec,
            dtypes.torch_dtype(c.kv_dtype),
            c.kv_slo_ms,
            ReuseStats(),
            LoadEstimates(),
        )
        self.blend = keying.blend  # ``auto`` resolved against the model's profile
        self.prefiller = Prefiller(self.parts)
        self.computing = ComputingChunks()
        self._wake: Callable[[], None] = lambda: None
        self.loader = Loader(self.prefiller, lambda: self._wake(), stats=self.parts.stats)
        self._inline: list[Loaded] = []  # requests that do not use the cache: nothing to read
        store.use_model(model.config.layer_types, keying.codec_level, keying.codec_k_cap)
        store.protect_upcoming(c.eviction == "queue")
        self.prefetcher = Prefetcher(store) if c.prefetch and store.lower else None

    def watch(self, upcoming: Callable[[], list[ChunkKey]], wake: Callable[[], None]) -> None:
        """The serving loop's queue (``upcoming``: the keys queued requests will ask for, in run
        order), which the store prefetches and protects by, and how to wake the loop when a load
        is done."""
        self._wake = wake
        self.store.set_lookahead(upcoming)

    # -- a request's roles ----------------------------------------------------------------------

    def key(
        self,
        prompt: Prompt,
        cache: CacheOptions,
        blend: BlendOptions | None,
        max_tokens: int,
        request_id: str = "",
        cancel: threading.Event | None = None,
    ) -> Reuse:
        """Key a request (hashing only); ``blend`` None: the engine's."""
        r = self.parts.keying.key(prompt, cache, blend, max_tokens, request_id, cancel)
        if self.prefetcher is not None:
            self.prefetcher.wake()
        return r

    def check(self, prompt: Prompt, cache: CacheOptions, blend: BlendOptions | None) -> None:
        """ValueError for what the cache can never serve: a blend check layer the model lacks."""
        check_blend(self.model, self.parts.keying.resolve(blend), prompt, cache.enabled)

    def begin(self, r: Reuse, kv: KVCache, tag: object) -> None:
        """Plan and load ``r`` into ``kv`` off the step; ``ready()`` returns ``tag`` when done."""
        if r.keys is None:
            self._inline.append(Loaded(tag, uncached(r)))
            self._wake()
        else:
            self.loader.start(r, kv, tag)

    def ready(self) -> list[Loaded]:
        """The sequences whose plan and loads are done since the last call."""
        out, self._inline = self._inline + self.loader.done(), []
        return out

    def loading(self) -> int:
        return self.loader.busy() + len(self._inline)

    def wait_loads(self, timeout: float = LOADS_TIMEOUT_S) -> None:
        """Nothing else runs: wait for the loads in flight rather than step without them."""
        self.loader.wait_idle(timeout)

    def load(self, r: Reuse, kv: KVCache, ready: ReadyPlan, chunked: bool = True) -> Filled | None:
        """On the step: what the plan needs the model for (documents, a blend, a KV stream);
        None when the request was cancelled meanwhile."""
        filled = self.prefiller.fill(r, kv, ready, chunked)
        if filled is not None:
            self.computing.planned(r)
        return filled

    def load_now(self, r: Reuse, kv: KVCache, chunked: bool = False) -> Filled | None:
        """Both halves on the caller's thread (``Engine.score``)."""
        ready = self.prefiller.plan(r, kv, chunked) if r.keys is not None else uncached(r)
        return self.load(r, kv, ready, chunked)

    def prefilled(self, r: Reuse, kv: KVCache, ids: list[int]) -> None:
        """The prompt's KV is complete and its first token sampled: count what it reused, save
        its new chunks, keep what it reused as long as it asks."""
        r.count()
        self.prefiller.measure(r)
        self.parts.writer.after_prefill(r, kv, ids)
        self.computing.done(r)

    def finish(self, r: Reuse, kv: KVCache | None, generated: list[int]) -> None:
        """The request is done: its history (or answer) saved when its KV is whole; its figures
        into the counters."""
        if kv is not None and r.counted:
            self.parts.writer.after_turn(r, kv, generated)
        self.computing.done(r)
        self.parts.stats.add(**r.counters())
        self.parts.keying.guard.sample(r, generated)

    def verify_one(self, score) -> bool:
        """Idle work: check one sampled blended request against a full prefill (the online
        guard, ``guard.BlendGuard``) with ``score`` (``Engine.score``); False when none waits."""
        return self.parts.keying.guard.verify_one(score)

    def release(self, r: Reuse) -> None:
        """``r``'s live KV is about to be freed (preempted): wait until the saver copied out the
        chunks its plan stores (their bytes live in that cache)."""
        self.computing.done(r)
        if r.plan is not None and r.plan.saves:
            self.parts.saver.wait((s.key for s in r.plan.saves), below=False)
        r.preempted()

    def settle(self, timeout: float = 0.5) -> None:
        """Wait a little for queued saves (they hold finished requests' KV budget)."""
        self.parts.saver.flush(timeout)

    # -- the cache as a whole -------------------------------------------------------------------

    def namespace(self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None):
        return self.parts.keying.namespace(tenant, salt, blend)

    def document_context(
        self, blend: BlendOptions | None = None, prefix: Seq[int] | None = None
    ) -> tuple[int, ...]:
        """What documents are computed behind when cached alone (``Keying.document_context``)."""
        return self.parts.keying.document_context(blend, prefix)

    def resolve(self, blend: BlendOptions | None) -> BlendOptions:
        """``blend`` (None: the engine's) with ``recompute_ratio: auto`` resolved by the profile."""
        return self.parts.keying.resolve(blend)

    def precompute_documents(
        self,
        documents: Seq[list[int]],
        cache: CacheOptions,
        blend: BlendOptions | None,
        prefix: list[int] | None,
        on_document: Callable[[int, bool], None] | None = None,
    ) -> dict[str, int]:
        return offline.precompute_documents(
            self.parts, self.model_lock, documents, cache, blend, prefix, on_document
        )

    def counters(self) -> dict:
        """Reuse counters, the histories remembered, the saver's figures, the online guard's."""
        p = self.parts
        return {**p.stats.snapshot(), **p.writer.counters(), **p.keying.guard.counters()}

    def tier_stats(self) -> dict[str, dict]:
        return self.store.stats()

    def tenant_usage(self) -> dict:
        return self.store.tenant_usage()

    def clear(self, tenant: str, salt: str | None = None, timeout: float | None = None) -> Cleared:
        """Every entry of ``tenant``, or of every namespace derived from its ``salt`` (plain,
        blended, history-derived, any model: they share the salt's key prefix)."""
        prefix = tenant_tag(tenant) if salt is None else salt_prefix(tenant, salt)
        return self.parts.writer.clear(prefix, timeout)

    def free(self, keys: Seq[str], timeout: float | None = None) -> dict[str, int]:
        return self.parts.writer.free(keys, timeout) if keys else {}

    def flush(self, timeout: float | None = None) -> bool:
        return self.parts.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the loader and the prefetcher, save what is queued and flush the store (within
        ``timeout``: ``CacheWriter.close``), then close the saver and the store."""
        self.loader.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        return self.parts.writer.close(timeout)


class NoCache:
    """``CacheEngine``'s face with the cache off: every prompt computed whole, nothing kept."""

    enabled = False

    def __init__(self, model: LoadedModel, settings: EngineSettings, context_window: int):
        self.model = model
        self.keying = Keying(model, None, None, settings, None, context_window)
        self.blend = self.keying.blend
        self.computing = ComputingChunks()
        self._ready: list[Loaded] = []
        self._wake: Callable[[], None] = lambda: None

    def watch(self, upcoming: Callable[[], list[ChunkKey]], wake: Callable[[], None]) -> None:
        self._wake = wake

    def key(self, prompt, cache, blend, max_tokens, request_id="", cancel=None) -> Reuse:
        return self.keying.key(prompt, cache, blend, max_tokens, request_id, cancel)

    def check(self, prompt: Prompt, cache: CacheOptions, blend: BlendOptions | None) -> None:
        check_blend(self.model, self.keying.resolve(blend), prompt, False)

    def begin(self, r: Reuse, kv: KVCache, tag: object) -> None:
        self._ready.append(Loaded(tag, uncached(r)))
        self._wake()

    def ready(self) -> list[Loaded]:
        out, self._ready = self._ready, []
        return out

    def loading(self) -> int:
        return len(self._ready)

    def wait_loads(self, timeout: float = 0.0) -> None:
        pass

    def load(self, r: Reuse, kv: KVCache, ready: ReadyPlan, chunked: bool = True) -> Filled | None:
        if r.cancel.is_set():
            return None
        kv.truncate(0)
        source = KVSource({}, {}, None)
        r.filled = execute(self.model.runner, kv, r.prompt.ids, r.plan, source, defer_last=chunked)
        return r.filled

    def load_now(self, r: Reuse, kv: KVCache, chunked: bool = False) -> Filled | None:
        return self.load(r, kv, uncached(r), chunked)

    def prefilled(self, r: Reuse, kv: KVCache, ids: list[int]) -> None:
        r.count()

    def finish(self, r: Reuse, kv: KVCache | None, generated: list[int]) -> None:
        pass

    def release(self, r: Reuse) -> None:
        r.preempted()

    def settle(self, timeout: float = 0.5) -> None:
        pass

    def verify_one(self, score) -> bool:
        return False

    def namespace(self, tenant: str = "", salt: str = "", blend: BlendOptions | None = None):
        return self.keying.namespace(tenant, salt, blend)

    def document_context(
        self, blend: BlendOptions | None = None, prefix: Seq[int] | None = None
    ) -> tuple[int, ...]:
        return self.keying.document_context(blend, prefix)

    def resolve(self, blend: BlendOptions | None) -> BlendOptions:
        return self.keying.resolve(blend)

    def precompute_documents(self, *args, **kwargs) -> dict[str, int]:
        raise ValueError("precompute needs the KV cache, and it is disabled in this configuration")

    def counters(self) -> dict:
        return {}

    def tier_stats(self) -> dict[str, dict]:
        return {}

    def tenant_usage(self) -> dict:
        return {}

    def clear(self, tenant: str, salt: str | None = None, timeout: float | None = None) -> Cleared:
        return Cleared({}, True)

    def free(self, keys: Seq[str], timeout: float | None = None) -> dict[str, int]:
        return {}

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> bool:
        return True


def uncached(r: Reuse) -> ReadyPlan:
    """The plan of a request that does not use the cache: compute everything."""
    r.plan = full_prefill(r.prompt)
    return ReadyPlan(r.plan, FetchedEntries(), False)


def check_blend(model: LoadedModel, blend: BlendOptions, prompt: Prompt, cached: bool) -> None:
    """ValueError for a blend check layer the model lacks, or documents to blend uncached."""
    if blend.check_layer >= model.config.num_layers:
        raise ValueError(f"blend check_layer {blend.check_layer} is not a layer of this model")
    if prompt.documents and blend.blends and not cached:
        raise ValueError("documents need the KV cache: it is disabled for this request")


def open_cache(
    model: LoadedModel,
    store: TieredStore | None,
    settings: EngineSettings,
    context_window: int,
    model_lock: threading.Lock,
) -> CacheEngine | NoCache:
    """The cache engine over ``store``, or ``NoCache`` without one."""
    if store is None:
        return NoCache(model, settings, context_window)
    return CacheEngine(model, store, settings, context_window, model_lock)
