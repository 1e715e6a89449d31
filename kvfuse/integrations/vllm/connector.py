"""``KvfuseConnector``: vLLM's V1 KV connector API on top of kvfuse's tiered store.

Start vLLM with::

    --kv-transfer-config '{"kv_connector": "KvfuseConnector",
                           "kv_connector_module_path": "kvfuse.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"disk_path": "/var/cache/kvfuse", "chunk_size": 256}}'

(``docs/vllm.md``). The scheduler-side instance answers lookups (``get_num_new_matched_tokens``:
kvfuse prefix keys of the request's full chunks, ``TieredStore.lookup``: side-effect free) and
plans each step's loads and saves (``plan.Bookkeeper``); the worker-side instance carries them out
on vLLM's paged KV tensors (``worker.KVWorker``), whose layout it learns from vLLM's own attention
backend (``layout.probe_layout``). This module is the only one that imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvfuse.codecs import get_codec
from kvfuse.counters import Counters
from kvfuse.integrations.vllm.blocks import check_alignment
from kvfuse.integrations.vllm.layout import BlockLayout, LayoutError, probe_layout
from kvfuse.integrations.vllm.plan import Bookkeeper, CachedRequest, NewRequest, StepPlan
from kvfuse.integrations.vllm.settings import (
    kv_namespace,
    model_fingerprint,
    read_settings,
    weights_digest,
)
from kvfuse.integrations.vllm.stores import acquire_store, release_store
from kvfuse.integrations.vllm.worker import CacheLayers, KVWorker
from kvfuse.kv.keys import Namespace, prefix_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _route_logs() -> None:
    """Send the connector's log records through vLLM's handlers (vLLM configures only its own
    ``vllm`` logger; without this, kvfuse's info lines would be dropped)."""
    ours, theirs = logging.getLogger("kvfuse.integrations.vllm"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


_route_logs()

_TIER_SOURCES = {
    "memory": "HOST",
    "disk": "DISK",
}  # kvfuse tier -> vLLM CacheHitSource (others: unspecified)


class KvfuseConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler-side connector to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KvfuseConnectorStats(KVConnectorStats):
    """Counter deltas (``name`` or ``name.label`` -> value) from the connector's two sides, summed
    over workers and intervals; vLLM logs them as "KV Transfer metrics" and feeds Prometheus."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Prometheus counters: stats key (before ".label") -> (metric name, help, label name or None)
_PROM = {
    "hit_tokens": (
        "vllm:kvfuse_hit_tokens",
        "Prompt tokens vLLM took from kvfuse instead of computing them.",
        None,
    ),
    "hit_tokens_by_tier": (
        "vllm:kvfuse_hit_tokens_by_tier",
        "Tokens taken from kvfuse, by the tier found at lookup.",
        "tier",
    ),
    "lookups": ("vllm:kvfuse_lookups", "Requests admitted after a kvfuse lookup.", None),
    "loaded_chunks": (
        "vllm:kvfuse_loaded_chunks",
        "Chunks loaded from kvfuse into vLLM's KV cache.",
        None,
    ),
    "loaded_chunks_by_tier": (
        "vllm:kvfuse_loaded_chunks_by_tier",
        "Chunks loaded, by the tier that served them.",
        "tier",
    ),
    "loaded_tokens": (
        "vllm:kvfuse_loaded_tokens",
        "Tokens of KV written into vLLM's blocks by loads.",
        None,
    ),
    "load_failed_chunks": (
        "vllm:kvfuse_load_failed_chunks",
        "Chunk loads that failed (vLLM recomputed them).",
        None,
    ),
    "saved_chunks": ("vllm:kvfuse_saved_chunks", "Prompt chunks saved into kvfuse's store.", None),
    "saved_tokens": ("vllm:kvfuse_saved_tokens", "Prompt tokens saved into kvfuse's store.", None),
    "save_dropped": (
        "vllm:kvfuse_save_dropped",
        "Chunks not saved (save queue full or incomplete).",
        None,
    ),
    "save_errors": ("vllm:kvfuse_save_errors", "Chunks whose save failed.", None),
}


class KvfusePromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's ``/metrics``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, (name, doc, label) in _PROM.items():
            extra = [label] if label else []
            self._counters[key] = self._counter_cls(
                name=name, documentation=doc, labelnames=labelnames + extra
            )
        self._children: dict[tuple, Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, value in transfer_stats_data.items():
            base, _, label = key.partition(".")
            counter = self._counters.get(base)
            if counter is None or not value:
                continue
            child = self._children.get((engine_idx, key))
            if child is None:
                values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label else [])
                child = self._children[(engine_idx, key)] = counter.labels(*values)
            child.inc(value)


class _Deltas:
    """Counter deltas since the last call, flattened (``name.label`` for counts by name)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self) -> dict[str, float]:
        flat: dict[str, float] = {}
        for k, v in self.counters.snapshot().items():
            if isinstance(v, dict):
                flat.update({f"{k}.{label}": n for label, n in v.items()})
            else:
                flat[k] = v
        with self._lock:
            delta = {k: v - self._last.get(k, 0) for k, v in flat.items()}
            self._last = flat
        return {k: v for k, v in delta.items() if v}


def _model_identity(vllm_config: VllmConfig) -> str:
    """The model fingerprint of vLLM's model: name or folder, revision, dtype, quantization, its
    config.json and (local folders) a digest of the weight files."""
    mc = vllm_config.model_config
    model = str(mc.model)
    folder = Path(model)
    config: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        config = {"config.json": (folder / "config.json").read_text()}
    else:
        hf = getattr(mc, "hf_config", None)
        config = {
            "architectures": getattr(hf, "architectures", None),
            "model_type": getattr(hf, "model_type", None),
        }
    return model_fingerprint(
        str(folder.resolve()) if folder.exists() else model,
        revision=mc.revision,
        dtype=str(mc.dtype),
        quantization=mc.quantization,
        hf_config=config,
        weights=weights_digest(folder) if folder.is_dir() else None,
    )


def _check_parallelism(pc) -> None:
    """vLLM's parallelism the connector supports: tensor parallelism only (each rank keeps its own
    heads' KV, under its own keys); pipeline stages and context parallelism split a request's KV
    over workers in ways the connector's chunks do not follow."""
    for name in (
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        if getattr(pc, name, 1) != 1:
            raise ValueError(f"KvfuseConnector supports {name} = 1 only (got {getattr(pc, name)})")


class KvfuseConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by kvfuse's tiers; see the module docstring and docs/vllm.md."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = read_settings(self._kv_transfer_config.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        _check_parallelism(pc)
        self.spec = self._attention_spec(kv_cache_config)
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self.block_size = vllm_config.cache_config.block_size
        check_alignment(self.settings.chunk_size, self.block_size)
        self.tp_size = pc.tensor_parallel_size
        self.kv_dtype = str(self.spec.dtype).removeprefix("torch.")
        c = self.settings.config.cache
        self.codec = get_codec(c.codec, c.codec_level)
        self.store = acquire_store(self.settings.config)
        self.bookkeeper: Bookkeeper | None = None
        self.worker: KVWorker | None = None
        # req_id -> cache_salt (eligible requests)
        self._requests: OrderedDict[str, str | None] = OrderedDict()
        self._closed = False
        # kv_role: kv_both loads and saves, kv_consumer only loads, kv_producer only saves
        self.load_enabled = self.settings.load and self._kv_transfer_config.is_kv_consumer
        self.save_enabled = self.settings.save and self._kv_transfer_config.is_kv_producer
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler(vllm_config)
        else:
            self._deltas = None  # set when the worker exists (register_kv_caches)

    def _start_scheduler(self, vllm_config: VllmConfig) -> None:
        """The scheduler side: the model's fingerprint (the namespace of its keys), the bookkeeper
        that plans loads and saves, and the setup logged once (with a warning where a failed load
        would fail its request)."""
        self.fingerprint = self.settings.model_fingerprint or _model_identity(vllm_config)
        self._namespaces: OrderedDict[str | None, list[Namespace]] = OrderedDict()
        self.bookkeeper = Bookkeeper(
            self.settings.chunk_size,
            self.block_size,
            self._keys_for,
            self._lookup,
            load=self.load_enabled,
            save=self.save_enabled,
        )
        self._deltas = _Deltas(self.bookkeeper.counters)
        disk = self.settings.config.disk_path
        redis = any(t.kind == "redis" for t in self.settings.config.lower_tiers())
        log.info(
            "kvfuse connector (scheduler): chunks of %d tokens (%d blocks), KV %s %s, tiers %s (disk %s, "
            "redis %s), codec %s, model fingerprint %s, load %s, save %s, signed entries %s",
            self.settings.chunk_size,
            self.settings.chunk_size // self.block_size,
            self.kv_dtype,
            self._layout_name(0),
            [t.name for t in self.store.tiers],
            str(disk) if disk is not None else "off",
            "on" if redis else "off",
            self.codec.name,
            self.fingerprint,
            self.load_enabled,
            self.save_enabled,
            "on" if self.store.signer is not None else "off",
        )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute" and self.load_enabled:
            log.warning(
                "kvfuse connector: kv_load_failure_policy is %r: a chunk that fails to load (evicted, "
                'damaged, Redis down) fails its request. Set "kv_load_failure_policy": "recompute" '
                "in --kv-transfer-config to have vLLM recompute it instead.",
                policy,
            )

    # -- shared ------------------------------------------------------------------------------------

    @staticmethod
    def _attention_spec(kv_cache_config: KVCacheConfig):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"KvfuseConnector supports models with one KV cache group, this one has {len(groups)} "
                "(start vLLM with --disable-hybrid-kv-cache-manager)"
            )
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or "MLA" in type(spec).__name__:
            raise ValueError(
                f"KvfuseConnector supports full-attention K/V caches, not {type(spec).__name__}"
            )
        if getattr(spec, "non_causal", False):
            raise ValueError(
                "KvfuseConnector needs causal attention: a non-causal layer's KV depends on later tokens"
            )
        if spec.head_size_v != spec.head_size or getattr(spec, "num_head_slots", None) is not None:
            raise ValueError(
                "KvfuseConnector supports K and V of the same head size, one slot per KV head"
            )
        quant = getattr(spec, "kv_quant_mode", None)
        if quant is not None and getattr(quant, "name", "NONE") != "NONE":
            raise ValueError(
                f"KvfuseConnector does not support quantized KV caches ({quant.name}); "
                "use --kv-cache-dtype auto"
            )
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"KvfuseConnector supports float16, bfloat16 and float32 KV caches, not {spec.dtype}"
            )
        return spec

    def _layout_name(self, rank: int) -> str:
        ns = kv_namespace(
            "x",
            self.kv_dtype,
            len(self.layer_names),
            self.spec.num_kv_heads,
            self.spec.head_size,
            tp_rank=rank,
            tp_size=self.tp_size,
        )
        return ns.kv_layout

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._deltas is None:
            return None
        delta = self._deltas.take()
        return KvfuseConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvfuseConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvfusePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load / save_kv_layer run between the layers

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.close()
        release_store(self.store)

    # -- scheduler side ----------------------------------------------------------------------------

    def _rank_namespaces(self, cache_salt: str | None) -> list[Namespace]:
        got = self._namespaces.get(cache_salt)
        if got is None:
            got = [
                kv_namespace(
                    self.fingerprint,
                    self.kv_dtype,
                    len(self.layer_names),
                    self.spec.num_kv_heads,
                    self.spec.head_size,
                    salt=self.settings.config.cache.salt,
                    cache_salt=cache_salt,
                    tp_rank=r,
                    tp_size=self.tp_size,
                )
                for r in range(self.tp_size)
            ]
            self._namespaces[cache_salt] = got
            while len(self._namespaces) > 1024:
                self._namespaces.popitem(last=False)
        return got

    def _keys_for(self, tokens, cache_salt: str | None, n_chunks: int):
        c = self.settings.chunk_size
        head = list(tokens[: n_chunks * c])
        return [prefix_keys(head, c, ns) for ns in self._rank_namespaces(cache_salt)]

    def _lookup(self, keys):
        return self.store.lookup(keys, count=False).where

    @staticmethod
    def _eligible(request: Request) -> bool:
        """Requests whose KV is a function of their token ids alone (no images, prompt embeddings
        or LoRA adapters, which the token ids do not name)."""
        return (
            request.prompt_token_ids is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
            and getattr(request, "lora_request", None) is None
        )

    def _remember(self, request: Request) -> bool:
        if not self._eligible(request):
            return False
        self._requests[request.request_id] = request.cache_salt
        while len(self._requests) > 100_000:  # requests vLLM never reported finished
            self._requests.popitem(last=False)
        return True

    def on_new_request(self, request: Request) -> None:
        self._remember(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.bookkeeper is not None
        if not self._eligible(request):
            return 0, False
        try:
            m = self.bookkeeper.match(
                request.request_id, request.all_token_ids, request.cache_salt, num_computed_tokens
            )
        except Exception:  # the store failing is a miss, never a failed request
            log.exception("kvfuse: lookup failed for request %s", request.request_id)
            return 0, False
        return m.tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        assert self.bookkeeper is not None
        if self._remember(request):
            self.bookkeeper.allocated(request.request_id, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0 or self.bookkeeper is None:
            return {}
        out: dict[Any, int] = {}
        for tier, n in self.bookkeeper.hit_tiers(request.request_id, num_external_tokens).items():
            source = getattr(CacheHitSource, _TIER_SOURCES.get(tier, "EXTERNAL_UNSPECIFIED"))
            out[source] = out.get(source, 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.bookkeeper is not None
        scheduled = scheduler_output.num_scheduled_tokens
        new = []
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id not in self._requests or r.prompt_token_ids is None:
                continue
            new.append(
                NewRequest(
                    r.req_id,
                    r.prompt_token_ids,
                    self._requests[r.req_id],
                    r.block_ids[0],
                    r.num_computed_tokens,
                    scheduled.get(r.req_id, 0),
                )
            )
        cached = []
        c = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(c.req_ids):
            if req_id not in self._requests:
                continue
            blocks = c.new_block_ids[i]
            cached.append(
                CachedRequest(
                    req_id,
                    blocks[0] if blocks is not None else None,
                    c.num_computed_tokens[i],
                    scheduled.get(req_id, 0),
                    resumed=req_id in c.resumed_req_ids,
                )
            )
        try:
            plan = self.bookkeeper.plan(new, cached)
        except Exception:
            log.exception("kvfuse: planning the step failed; nothing is loaded or saved in it")
            plan = StepPlan()
        return KvfuseConnectorMetadata(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.bookkeeper is not None:
            self.bookkeeper.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None  # saves copy their KV during the step: the blocks can be freed now

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        views, layer, sig = self._layer_views(kv_caches)
        first = views[self.layer_names[0]]
        layout = probe_layout(
            first, self._writer(layer, first), self.spec.num_kv_heads, self.spec.head_size
        )
        rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        layers = CacheLayers(views, self.layer_names, layout, self.block_size)
        # auto: layer by layer on a GPU (reads and copies run while it computes); on the CPU, whole
        # entries before the forward pass (a loader thread would take cores from the forward pass:
        # measured 1.3-2.6x slower time to first token on the 2-core machine, docs/vllm.md)
        layerwise = (
            self.settings.layerwise if self.settings.layerwise is not None else first.is_cuda
        )
        self.worker = KVWorker(
            self.store,
            self.codec,
            layers,
            dtype=self.spec.dtype,
            kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_size,
            chunk_size=self.settings.chunk_size,
            rank=rank,
            layerwise=layerwise,
            save_queue=self.settings.save_queue,
        )
        self._deltas = _Deltas(self.worker.counters)
        self._log_worker(rank, first, sig, layout, layerwise)

    def _layer_views(self, kv_caches: dict[str, torch.Tensor]) -> tuple[dict, Any, tuple]:
        """Each attention layer's KV cache, checked: every layer has one of its own (no cross-layer
        KV sharing), all in one layout, so that the layout ``probe_layout`` learns on the first
        layer holds for every layer. Also the first attention layer and that layout's
        ``_signature``."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvfuseConnector: no KV cache for layers {missing[:3]}")
        views = {n: kv_caches[n] for n in self.layer_names}
        first = views[self.layer_names[0]]
        ptrs = {v.data_ptr() for v in views.values()}
        if len(ptrs) != len(views):
            raise ValueError(
                "KvfuseConnector does not support layers sharing one KV cache (cross-layer KV sharing)"
            )
        context = self._vllm_config.compilation_config.static_forward_context
        layer = context.get(self.layer_names[0])
        sig = self._signature(first, layer)
        for n in self.layer_names[1:]:
            if self._signature(views[n], context.get(n)) != sig:
                raise LayoutError(
                    f"KvfuseConnector needs every layer's KV cache in one layout; {n} differs from "
                    f"{self.layer_names[0]}: {self._signature(views[n], context.get(n))} vs {sig}"
                )
        return views, layer, sig

    def _log_worker(
        self, rank: int, first: torch.Tensor, sig: tuple, layout: BlockLayout, layerwise: bool
    ) -> None:
        """The worker side's setup, logged once: the layout learned, the tiers, the codec."""
        cc = self._vllm_config.cache_config
        log.info(
            "kvfuse connector (worker rank %d): %d layers, vLLM layout %s, backend %s%s, per-layer view %s %s "
            "(kernel blocks of %d tokens); per block: %s; tiers %s, codec %s, layerwise loads %s",
            rank,
            len(self.layer_names),
            getattr(cc, "kv_cache_layout", None),
            sig[3],
            f" (isa {sig[4]})" if sig[4] else "",
            list(first.shape),
            self.kv_dtype,
            layout.block_tokens,
            layout.describe(),
            [t.name for t in self.store.tiers],
            self.codec.name,
            f"{layerwise} ({'auto' if self.settings.layerwise is None else 'set'})",
        )

    @staticmethod
    def _signature(view: torch.Tensor, layer) -> tuple:
        impl = getattr(layer, "impl", None)
        backend = getattr(layer, "attn_backend", None)
        name = (
            backend.get_name()
            if backend is not None and hasattr(backend, "get_name")
            else type(impl).__name__
        )
        return (
            tuple(view.shape[1:]),
            tuple(view.stride()[1:]),
            view.dtype,
            name,
            getattr(layer, "isa", None),
        )

    @staticmethod
    def _writer(layer, view: torch.Tensor):
        """The backend's own KV writer for ``view``, as ``probe_layout`` calls it."""
        impl = getattr(layer, "impl", None)
        backend = getattr(layer, "attn_backend", None)
        name = (
            backend.get_name()
            if backend is not None and hasattr(backend, "get_name")
            else type(impl).__name__
        )
        if (
            impl is None
            or not hasattr(impl, "do_kv_cache_update")
            or getattr(backend, "forward_includes_kv_cache_update", True)
        ):
            raise LayoutError(
                f"the attention backend {name} writes its KV cache inside its forward pass, so kvfuse "
                "cannot learn its block layout; use a backend with a separate KV cache update "
                "(CPU_ATTN, FLASH_ATTN, TRITON_ATTN, FLASHINFER, FLEX_ATTENTION)"
            )

        def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            impl.do_kv_cache_update(layer, key, value, view, slots)

        return write

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfuseConnectorMetadata)
        if meta.plan.loads:
            self.worker.start_loads(meta.plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self.worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfuseConnectorMetadata)
        if meta.plan.saves:
            i = self.worker.layers.index.get(layer_name)
            if i is not None:
                self.worker.save_layer(layer_name, self.worker.layers.views[i], meta.plan.saves)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()
