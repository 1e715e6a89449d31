"""Prometheus metrics of one server app, in a registry of its own (never the process-global one).

Request-time metrics (latency histograms, requests by endpoint/status, cancellations) are
observed as requests finish. Cache and engine counters are read at scrape time through the
engine's narrow API (``engine.stats_snapshot()``, ``engine.cache_stats()``) by a custom
collector, so the tiers need no knowledge of Prometheus and the numbers can never drift from the
ones ``GET /v1/kv/stats`` reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvfuse.engine import GenerationResult, Outcome, RequestCancelled

from .vllm_metrics import VLLMCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU prefill of a few thousand tokens takes seconds; GPU TTFTs are tens of milliseconds.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

# TierStats counters -> (metric name, help)
_TIER_COUNTERS = {
    "hits": ("kvfuse_tier_hits", "Chunk reads served by the tier."),
    "misses": ("kvfuse_tier_misses", "Chunk reads the tier could not serve."),
    "bytes_out": ("kvfuse_tier_read_bytes", "Bytes read from the tier."),
    "bytes_in": ("kvfuse_tier_written_bytes", "Bytes written to the tier."),
    "puts": ("kvfuse_tier_puts", "Entries written to the tier."),
    "evictions": ("kvfuse_tier_evictions", "Entries evicted from the tier to make room."),
    "errors": ("kvfuse_tier_errors", "Tier failures (each treated as a miss or a dropped write)."),
    "dropped_writes": (
        "kvfuse_tier_dropped_writes",
        "Writes to the tier dropped (full write queue or failure).",
    ),
    "protected_evictions": (
        "kvfuse_tier_protected_evictions",
        "Entries of queued requests evicted anyway, for want of room (queue-aware eviction).",
    ),
    "expired": (
        "kvfuse_tier_expired",
        "Entries removed because their retention (prompt_cache_retention, a "
        "breakpoint's ttl, cache.retention) ran out.",
    ),
    "decrypt_failures": (
        "kvfuse_tier_decrypt_failures",
        "Values that did not open with the encryption keys (cache.encryption_key_file): "
        "other keys, altered, or not encrypted; read as misses.",
    ),
}
_STORE_COUNTERS = {
    "lookups": ("kvfuse_store_lookups", "Prefix lookups."),
    "lookup_keys": ("kvfuse_store_lookup_chunks", "Chunks asked for by lookups."),
    "lookup_hits": ("kvfuse_store_lookup_hit_chunks", "Chunks found by lookups."),
    "promotions": (
        "kvfuse_store_promotions",
        "Chunks copied up into the first tier after a lower-tier hit.",
    ),
    "unusable_entries": (
        "kvfuse_store_unusable_entries",
        "Entries read back damaged or not as expected (removed; each a miss, never used).",
    ),
    "queue_full_drops": (
        "kvfuse_store_write_queue_drops",
        "Lower-tier writes dropped because the write queue was full.",
    ),
    "prefetched": (
        "kvfuse_prefetched_chunks",
        "Entries of queued requests read from a lower tier into memory before they ran.",
    ),
    "prefetch_hits": (
        "kvfuse_prefetch_hits",
        "Entries a request found in memory because they were prefetched.",
    ),
    "prefetch_misses": (
        "kvfuse_prefetch_misses",
        "Entries a request still read from a lower tier while prefetching was on.",
    ),
    "reencoded": (
        "kvfuse_store_reencoded_chunks",
        "Entries re-encoded for a tier's own codec or a streaming level.",
    ),
    "reencode_errors": (
        "kvfuse_store_reencode_errors",
        "Entries a tier's codec could not encode (not written there).",
    ),
}
# Engine counters of conversations -> (metric name, help)
_HISTORY_COUNTERS = {
    "history_requests": (
        "kvfuse_history_requests",
        "Prompts lined up with a stored conversation history.",
    ),
    "history_tokens_reused": (
        "kvfuse_history_reused_tokens",
        "Prompt tokens whose KV came from a stored "
        "conversation history (previous prompts and answers).",
    ),
    "moved_tokens_reused": (
        "kvfuse_history_moved_tokens",
        "History tokens reused at new positions after the oldest "
        "turns were dropped (keys re-rotated).",
    ),
    "truncated_requests": (
        "kvfuse_truncated_requests",
        "Conversations that outgrew the context window.",
    ),
    "truncated_messages": (
        "kvfuse_truncated_messages",
        "Messages dropped from conversations beyond the context window.",
    ),
}
_SAVER_COUNTERS = {
    "saved_entries": ("kvfuse_saved_chunks", "Entries saved by the background saver."),
    "saved_bytes": ("kvfuse_saved_bytes", "Bytes of entries saved by the background saver."),
    "save_s": (
        "kvfuse_save_seconds",
        "Time the background saver spent saving (off the request path).",
    ),
    "save_jobs": ("kvfuse_save_jobs", "Save jobs handed to the background saver."),
    "handoff_s": (
        "kvfuse_save_handoff_seconds",
        "Time requests spent handing KV to the saver (on the request path).",
    ),
    "save_waits": (
        "kvfuse_save_waits",
        "Prefills that waited for KV still being saved (the previous turn's).",
    ),
    "save_wait_s": ("kvfuse_save_wait_seconds", "Time prefills waited for KV still being saved."),
    "save_errors": (
        "kvfuse_save_errors",
        "Save jobs that failed (their entries are misses later).",
    ),
    "skipped_jobs": (
        "kvfuse_save_queue_full_skips",
        "Save jobs not queued because the saver's queue (cache.save_queue) was full.",
    ),
    "skipped_spans": (
        "kvfuse_save_queue_full_skipped_chunks",
        "Chunks not stored because the saver's queue was full (later requests compute them).",
    ),
    "skipped_tasks": (
        "kvfuse_save_queue_full_skipped_tasks",
        "Promotions and lower-tier expiry extensions not made because the saver's queue was full.",
    ),
}


class CacheCollector(Collector):
    """Reads the engine's and the store's counters at scrape time."""

    def __init__(self, engine_getter: Callable[[], object | None]):
        self._engine = engine_getter

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        s = engine.stats_snapshot()
        yield from _engine_metrics(s)
        yield from _blend_metrics(s)
        yield from _backend_metrics(engine)
        yield from _memory_metrics(engine)
        yield from _reuse_metrics(s)
        yield from _stream_metrics(s)
        yield from _batch_metrics(s)
        yield from _saver_metrics(s.get("saver"))
        yield from _guard_metrics(s)
        if engine.cache_enabled:
            yield from _store_metrics(engine.cache_stats())


def _engine_metrics(s: dict) -> Iterator[Metric]:
    """The engine's totals: prompt tokens by where their KV came from, tokens generated, requests
    finished and skipped, chunks stored and cached chunks that could not be used."""
    tokens = CounterMetricFamily(
        "kvfuse_prompt_tokens",
        "Prompt tokens, by whether their KV was reused from the cache or prefilled.",
        labels=["source"],
    )
    tokens.add_metric(["cached"], s["tokens_reused"])
    tokens.add_metric(["prefilled"], s["tokens_prefilled"])
    yield tokens
    yield CounterMetricFamily(
        "kvfuse_generation_tokens", "Tokens generated.", value=s["tokens_generated"]
    )
    yield CounterMetricFamily(
        "kvfuse_engine_requests", "Requests the engine finished.", value=s["requests"]
    )
    yield CounterMetricFamily(
        "kvfuse_engine_requests_skipped",
        "Requests cancelled while they waited (never run).",
        value=s["requests_skipped"],
    )
    yield CounterMetricFamily(
        "kvfuse_chunks_stored", "KV chunks written to the store.", value=s["chunks_stored"]
    )
    yield CounterMetricFamily(
        "kvfuse_chunk_load_failures",
        "Cached chunks that could not be used.",
        value=s["chunk_load_failures"],
    )


def _reuse_metrics(s: dict) -> Iterator[Metric]:
    """Where reused KV came from: chunks by tier, and conversations lined up with a stored history
    (tokens reused, moved after truncation, truncations; the histories remembered)."""
    reused = CounterMetricFamily(
        "kvfuse_reused_chunks",
        "Chunks reused by requests, by the tier they came from.",
        labels=["tier"],
    )
    for tier, n in sorted(s["hits_by_tier"].items()):
        reused.add_metric([tier], n)
    yield reused
    for key, (name, help_) in _HISTORY_COUNTERS.items():
        yield CounterMetricFamily(name, help_, value=s.get(key, 0))
    if "history_records" in s:
        yield GaugeMetricFamily(
            "kvfuse_history_records",
            "Conversation histories whose token ids are remembered.",
            value=s["history_records"],
        )
        yield CounterMetricFamily(
            "kvfuse_history_records_refused",
            "History records read back and refused: unsigned or badly signed with signing on, "
            "or naming entries outside their scope (never used).",
            value=s.get("history_records_refused", 0),
        )


def _stream_metrics(s: dict) -> Iterator[Metric]:
    """CacheGen streaming (``kv_slo_ms``): prompts streamed, budgets missed, bytes read, and the
    chunks by the encoding each load picked."""
    yield CounterMetricFamily(
        "kvfuse_stream_requests",
        "Prompts whose slow-tier KV was streamed within kv_slo_ms (CacheGen).",
        value=s.get("streamed_requests", 0),
    )
    yield CounterMetricFamily(
        "kvfuse_stream_slo_violations",
        "Streamed loads that took longer than kv_slo_ms.",
        value=s.get("stream_slo_violations", 0),
    )
    yield CounterMetricFamily(
        "kvfuse_stream_read_bytes",
        "Bytes read by streamed loads.",
        value=s.get("stream_bytes", 0),
    )
    streamed = CounterMetricFamily(
        "kvfuse_stream_chunks",
        "Streamed chunks, by the encoding read (raw, "
        "cachegen.N) or recompute (no encoding fit the budget).",
        labels=["encoding"],
    )
    for encoding, n in sorted(s.get("stream_chunks", {}).items()):
        streamed.add_metric([encoding], n)
    yield streamed


def _saver_metrics(saver: dict | None) -> Iterator[Metric]:
    """The background saver (none in an engine without one): what it saved, the time it took off
    and on the request path, the waits it caused, the entries still pending."""
    if saver is None:
        return
    for key, (name, help_) in _SAVER_COUNTERS.items():
        yield CounterMetricFamily(name, help_, value=saver.get(key, 0))
    yield GaugeMetricFamily(
        "kvfuse_save_max_seconds",
        "The longest save job so far.",
        value=saver.get("save_max_s", 0.0),
    )
    yield GaugeMetricFamily(
        "kvfuse_saves_pending",
        "Entries handed to the saver and not saved yet.",
        value=saver.get("pending", 0),
    )


def _backend_metrics(engine) -> Iterator[Metric]:
    """The model's CPU path (``models.cpu.backend``, chosen once at load) as an info gauge."""
    backend = getattr(getattr(engine, "model", None), "backend", None)
    if backend is None:
        return
    info = backend.info()
    family = GaugeMetricFamily(
        "kvfuse_cpu_backend_info",
        "The CPU path the model was loaded with (kernels: auto | on | off): whether kvfuse's "
        "kernels run (kernels), the projections' form (weights) and the instruction set the "
        "kernels chose at run time (isa: avx512 | avx2 | none).",
        labels=sorted(info),
    )
    family.add_metric([info[k] for k in sorted(info)], 1)
    yield family
    from ..models.cpu import kernels

    cpu = GaugeMetricFamily(
        "kvfuse_cpu_info",
        "The CPU this server runs on: its model name and the instruction sets of it that decide "
        "kvfuse's kernels and PyTorch's GEMMs (features, space-separated).",
        labels=["model", "features"],
    )
    cpu.add_metric([kernels.cpu_model() or "", " ".join(kernels.listed_features())], 1)
    yield cpu


def _memory_metrics(engine) -> Iterator[Metric]:
    """The process's resident size and the model's weights as loaded (``kvfuse.resident``)."""
    from ..resident import resident_bytes, weights_bytes

    rss = resident_bytes()
    if rss is not None:
        yield GaugeMetricFamily(
            "kvfuse_resident_memory_bytes", "This server process's resident size (VmRSS).", rss
        )
    runner = getattr(getattr(engine, "model", None), "runner", None)
    if runner is not None:
        yield GaugeMetricFamily(
            "kvfuse_weights_bytes",
            "The model's weights as the runner holds them (a GGUF's blocks with weights: auto).",
            weights_bytes(runner.weights),
        )
    heap = getattr(engine, "heap", None)
    if heap is not None:
        yield CounterMetricFamily(
            "kvfuse_heap_releases",
            "Times the idle engine gave the heap's freed buffers back (engine.release_idle_s).",
            value=heap.releases,
        )
        yield CounterMetricFamily(
            "kvfuse_heap_released_bytes",
            "Resident bytes those releases gave back to the kernel.",
            value=heap.released_bytes,
        )


def _blend_metrics(s: dict) -> Iterator[Metric]:
    """Blends (documents, found spans): requests, recomputed tokens, budgets; automatic reuse."""
    yield CounterMetricFamily(
        "kvfuse_blend_requests", "Requests with documents (blended).", value=s["blended_requests"]
    )
    yield CounterMetricFamily(
        "kvfuse_blend_recomputed_tokens",
        "Document (and found passage) tokens recomputed in context by blends.",
        value=s["tokens_recomputed"],
    )
    blends = CounterMetricFamily(
        "kvfuse_blend_budget_requests",
        "Requests with documents (or with passages found "
        "by automatic reuse), by how they were used: method (prefix: not blended), budget "
        "and its source (profile, default, config, request).",
        labels=["method", "recompute_ratio", "source"],
    )
    for label, n in sorted(s.get("blends", {}).items()):
        blends.add_metric(label.split(":"), n)
    yield blends
    yield from _auto_reuse_metrics(s)


_GUARD_COUNTERS = {
    "blend_verify_sampled": (
        "kvfuse_blend_verify_sampled",
        "Blended requests sampled for the online guard's check (blend.verify_rate).",
    ),
    "blend_verify_dropped": (
        "kvfuse_blend_verify_dropped",
        "Sampled requests dropped because too many checks were waiting for idle time.",
    ),
    "blend_verified": (
        "kvfuse_blend_verified",
        "Blended requests checked against a full prefill of the same prompt.",
    ),
    "blend_verify_agreed": (
        "kvfuse_blend_verify_agreed",
        "Checked requests whose first answer tokens a full prefill predicts alike.",
    ),
    "blend_fallbacks": (
        "kvfuse_blend_fallbacks",
        "Times the online guard turned blending off (agreement below blend.verify_target).",
    ),
}


def _guard_metrics(s: dict) -> Iterator[Metric]:
    """The online blend guard (only when ``blend.verify_rate`` > 0)."""
    if "blend_verify_agreement" not in s:
        return
    for key, (name, help_) in _GUARD_COUNTERS.items():
        yield CounterMetricFamily(name, help_, value=s.get(key, 0))
    yield GaugeMetricFamily(
        "kvfuse_blend_verify_agreement",
        "Agreement of blended answers with full prefill over the guard's window (-1: none yet).",
        value=s["blend_verify_agreement"],
    )
    yield GaugeMetricFamily(
        "kvfuse_blend_verify_kl",
        "KL divergence of the first token's distribution, last check (-1: none yet).",
        value=s["blend_verify_last_kl"],
    )
    yield GaugeMetricFamily(
        "kvfuse_blend_fallback",
        "1 while the online guard has blending off (exact prefix reuse), else 0.",
        value=s["blend_fallback"],
    )


def _auto_reuse_metrics(s: dict) -> Iterator[Metric]:
    """Automatic reuse: requests by what it did, content chunks found and missing, tokens reused."""
    requests = CounterMetricFamily(
        "kvfuse_auto_reuse_requests",
        "Requests by what automatic reuse did: off, skipped "
        "(documents, breakpoints, no cache), prefix (the model's blend is prefix: nothing "
        "blended), none_found, blended.",
        labels=["status"],
    )
    for status, n in sorted(s.get("auto_requests", {}).items()):
        requests.add_metric([status], n)
    yield requests
    spans = CounterMetricFamily(
        "kvfuse_auto_reuse_span_lookups",
        "Content chunks of plain prompts looked up after "
        "their prefix hit, by whether a tier held them.",
        labels=["result"],
    )
    spans.add_metric(["hit"], s.get("span_hits", 0))
    spans.add_metric(["miss"], s.get("span_misses", 0))
    yield spans
    yield CounterMetricFamily(
        "kvfuse_auto_reuse_span_tokens",
        "Prompt tokens reused from passages found at other "
        "positions (after blending: not those recomputed).",
        value=s.get("span_tokens_reused", 0),
    )


def _histogram(name: str, help_: str, counts: dict, total: float) -> HistogramMetricFamily:
    """A histogram from counts per bucket upper bound (the engine's power-of-two buckets)."""
    buckets, running = [], 0
    for bound in sorted(int(b) for b in counts):
        running += counts[str(bound)]
        buckets.append((str(bound), running))
    buckets.append(("+Inf", running))
    return HistogramMetricFamily(name, help_, buckets=buckets, sum_value=total)


def _batch_metrics(s: dict) -> Iterator[Metric]:
    """Continuous batching: steps, sequences and tokens per step, preemptions."""
    yield CounterMetricFamily(
        "kvfuse_engine_steps", "Batched forward passes the engine ran.", value=s.get("steps", 0)
    )
    yield _histogram(
        "kvfuse_batch_sequences",
        "Sequences per forward pass (decodes and prompt chunks).",
        s.get("batch_sizes", {}),
        s.get("step_sequences", 0),
    )
    yield _histogram(
        "kvfuse_batch_tokens",
        "Tokens per forward pass.",
        s.get("step_token_counts", {}),
        s.get("step_tokens", 0),
    )
    yield CounterMetricFamily(
        "kvfuse_preemptions",
        "Running sequences whose KV was freed to make room for older "
        "ones (each ran again later, keeping its output).",
        value=s.get("preemptions", 0),
    )


def _store_metrics(stats: dict[str, dict]) -> Iterator[Metric]:
    tiers = {name: c for name, c in stats.items() if name != "store"}
    for key, (name, help_) in _TIER_COUNTERS.items():
        family = CounterMetricFamily(name, help_, labels=["tier"])
        for tier, c in tiers.items():
            family.add_metric([tier], c.get(key, 0))
        yield family
    for key, name, help_ in (
        ("entries", "kvfuse_tier_entries", "Entries held by the tier."),
        ("used_bytes", "kvfuse_tier_used_bytes", "Bytes held by the tier."),
        (
            "capacity_bytes",
            "kvfuse_tier_capacity_bytes",
            "The tier's capacity (memory and disk: cache.memory_bytes, cache.disk_bytes).",
        ),
    ):
        family = GaugeMetricFamily(name, help_, labels=["tier"])
        for tier, c in tiers.items():
            if c.get(key) is not None:
                family.add_metric([tier], c[key])
        yield family
    store = stats.get("store", {})
    for key, (name, help_) in _STORE_COUNTERS.items():
        yield CounterMetricFamily(name, help_, value=store.get(key, 0))
    refused = CounterMetricFamily(
        "kvfuse_store_signature_rejects",
        "Entries read from disk, Redis or S3 with signing "
        "on that were unsigned or signed by no accepted key (removed; each a miss, never "
        "used; counted in kvfuse_store_unusable_entries too).",
        labels=["reason"],
    )
    for reason, key in (("unsigned", "signature_unsigned"), ("mismatch", "signature_mismatch")):
        refused.add_metric([reason], store.get(key, 0))
    yield refused
    yield GaugeMetricFamily(
        "kvfuse_store_write_queue_depth",
        "Lower-tier writes waiting.",
        value=store.get("queue_depth", 0),
    )


class TenantCollector(Collector):
    """Per-tenant series of the tenants with a byte quota in a tier (``tenants:``), read at scrape
    time (``engine.tenant_usage()``): bytes and entries held, the quota, the evictions it caused.
    Tenants are named by ``names`` (tenant tag -> name); a tag no configured tenant has (entries
    of a tenant since removed from ``server.api_keys``) is shown as ``tag:<tag>``."""

    def __init__(self, engine_getter: Callable[[], object | None], names: Mapping[str, str]):
        self._engine = engine_getter
        self._names = dict(names)

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        usage = engine.tenant_usage() if engine is not None and engine.cache_enabled else {}
        families = {
            key: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_, labels=["tenant", "tier"]
            )
            for key, (name, kind, help_) in _TENANT_SERIES.items()
        }
        for tier, tenants in sorted(usage.items()):
            for tag, u in sorted(tenants.items()):
                for key, family in families.items():
                    family.add_metric([self._names.get(tag, f"tag:{tag}"), tier], u[key])
        yield from families.values()


# tier.tenant_usage() fields -> (metric name, type, help)
_TENANT_SERIES = {
    "used_bytes": (
        "kvfuse_tenant_used_bytes",
        "gauge",
        "Bytes a tenant with a quota holds in the tier.",
    ),
    "entries": (
        "kvfuse_tenant_entries",
        "gauge",
        "Entries a tenant with a quota holds in the tier.",
    ),
    "quota_bytes": (
        "kvfuse_tenant_quota_bytes",
        "gauge",
        "The tenant's byte quota in the tier (tenants.<name>.quota.<tier>_bytes).",
    ),
    "quota_evictions": (
        "kvfuse_tenant_quota_evictions",
        "counter",
        "Entries of the tenant evicted because it was over its quota in the tier (its own oldest).",
    ),
}


def _declare_queue_gauges(r: CollectorRegistry, queue: Callable[[], dict[str, int]]) -> None:
    """The queue and the live KV memory, read from ``queue()`` at scrape time (so they are never
    stale): requests waiting and running, KV bytes held, their peak and their budget."""
    Gauge("kvfuse_queue_depth", "Requests waiting in the queue.", registry=r).set_function(
        lambda: queue().get("waiting", 0)
    )
    Gauge("kvfuse_requests_running", "Requests being generated.", registry=r).set_function(
        lambda: queue().get("running", 0)
    )
    Gauge(
        "kvfuse_kv_memory_bytes",
        "Live KV memory held by running sequences (engine.kv_memory_bytes bounds it).",
        registry=r,
    ).set_function(lambda: queue().get("kv_bytes_used", 0))
    Gauge(
        "kvfuse_kv_memory_peak_bytes", "The most live KV memory held at once.", registry=r
    ).set_function(lambda: queue().get("kv_bytes_peak", 0))
    Gauge(
        "kvfuse_kv_memory_limit_bytes", "The live KV memory budget (0: unbounded).", registry=r
    ).set_function(lambda: queue().get("kv_bytes_limit", 0))


class ServerMetrics:
    """The metrics of one app. ``render()`` gives the Prometheus text exposition. ``tenant_names``:
    tenant tag -> name, for the per-tenant series (``TenantCollector``)."""

    def __init__(
        self,
        engine_getter: Callable[[], object | None],
        queue: Callable[[], dict[str, int]],
        tenant_names: Mapping[str, str] | None = None,
    ):
        r = self.registry = CollectorRegistry()
        self._declare_request_metrics(r)
        _declare_queue_gauges(r, queue)
        self._declare_api_metrics(r)
        r.register(CacheCollector(engine_getter))
        r.register(TenantCollector(engine_getter, tenant_names or {}))
        r.register(VLLMCollector(engine_getter, queue))  # vLLM's names, for routers

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """The metrics observed as requests finish: requests by endpoint and status, latencies
        (time to first token, per output token, saving, queueing), cancellations, refusals."""
        self.requests = Counter(
            "kvfuse_http_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvfuse_time_to_first_token_seconds",
            "Time from queueing a request to its first generated token (queue wait + lookup + load "
            "+ prefill).",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvfuse_time_per_output_token_seconds",
            "Mean decode time per output token after the first, one observation per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.save_path = Histogram(
            "kvfuse_request_save_seconds",
            "Time each request spent on saving its KV on the request path (handing it to the "
            "saver; the saving itself runs off the request path).",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvfuse_queue_wait_seconds",
            "Time requests waited in the queue.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.cancelled = Counter(
            "kvfuse_requests_cancelled",
            "Requests whose client left: skipped while queued, or stopped while generating.",
            ["stage"],
            registry=r,
        )
        self.rejected = Counter(
            "kvfuse_requests_rejected", "Requests refused because the queue was full.", registry=r
        )

    def _declare_api_metrics(self, r: CollectorRegistry) -> None:
        """The API's own counters: the Responses API's stored responses, tenants' refused requests."""
        self.responses = Counter(
            "kvfuse_responses",
            "Responses API: responses by event (created, stored, continued "
            "from previous_response_id, deleted, expired, record_refused: a stored history "
            "record unsigned, badly signed or outside its scope, not used).",
            ["event"],
            registry=r,
        )
        self.stored_responses = Gauge(
            "kvfuse_stored_responses", "Responses API: responses stored (all tenants).", registry=r
        )
        self.quota_rejections = Counter(
            "kvfuse_tenant_rejected_requests",
            "Requests refused (429) because the "
            "tenant was over a quota, by tenant and limit (requests_per_minute).",
            ["tenant", "limit"],
            registry=r,
        )

    def observe_outcome(self, outcome: Outcome) -> None:
        """Count one finished request (called on the engine thread; prometheus_client is thread-safe)."""
        if outcome.result is not None:
            self.observe_result(outcome.result)
        elif isinstance(outcome.error, RequestCancelled):
            self.cancelled.labels(stage="queued").inc()

    def observe_result(self, result: GenerationResult) -> None:
        t = result.timings
        self.queue_wait.observe(t.queued_s)
        if t.ttft_s > 0:  # 0 when cancelled before the prefill
            self.ttft.observe(t.queued_s + t.ttft_s)
        self.save_path.observe(t.store_s)
        if result.completion_tokens > 1 and t.decode_s > 0:
            self.tpot.observe(t.decode_s / (result.completion_tokens - 1))
        if result.finish_reason == "cancelled":
            self.cancelled.labels(stage="running").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
