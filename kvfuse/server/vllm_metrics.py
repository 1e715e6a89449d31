"""The load metrics routers read from a vLLM worker, under vLLM's names, next to kvfuse's own.

Routers and gateways (SMG, the llm-d endpoint picker, vllm-router's load-aware policies) score a
worker by scraping ``/metrics`` for vLLM's series. kvfuse exports them with vLLM's meanings and
labels (``model_name``, ``engine``: kvfuse has one engine, ``"0"``), computed from the same
figures as kvfuse's own series (which stay):

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: sequences in the running batch /
  requests queued (``kvfuse_requests_running`` / ``kvfuse_queue_depth``);
- ``vllm:kv_cache_usage_perc``: the fraction (0..1, "1 means 100 percent") of the live KV budget
  in use. vLLM's is the share of its GPU KV blocks held by running requests; kvfuse's live KV is
  the running sequences' memory, so with ``engine.kv_memory_bytes`` set it is
  used / limit, and without a budget (unbounded) the running batch's share of its slots
  (running / ``engine.max_running``), the other bound on what a worker can take on;
- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (counters, ``_total``): prompt
  tokens looked up and prompt tokens whose KV was reused, vLLM V1's prefix-cache pair;
- ``vllm:gpu_prefix_cache_hit_rate``: vLLM V0's gauge, still read by older gateways:
  hits / queries since start (0 before any prompt). kvfuse's "prefix cache" spans its tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LABELS = ("model_name", "engine")


def kv_cache_usage(queue: dict[str, int]) -> float:
    """``vllm:kv_cache_usage_perc`` from the scheduler's state (see the module docstring)."""
    limit = queue.get("kv_bytes_limit", 0)
    if limit > 0:
        return min(1.0, queue.get("kv_bytes_used", 0) / limit)
    slots = queue.get("max_running", 0)
    return min(1.0, queue.get("running", 0) / slots) if slots > 0 else 0.0


def prefix_cache(stats: dict) -> tuple[int, int]:
    """(tokens queried, tokens hit): every prompt token is looked up; the reused ones hit."""
    hits = int(stats.get("tokens_reused", 0))
    return hits + int(stats.get("tokens_prefilled", 0)), hits


class VLLMCollector(Collector):
    """vLLM's series, read at scrape time from the engine's counters and ``queue()`` (the same
    figures as kvfuse's queue gauges); nothing before the engine exists."""

    def __init__(
        self, engine_getter: Callable[[], object | None], queue: Callable[[], dict[str, int]]
    ):
        self._engine, self._queue = engine_getter, queue

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        model = getattr(engine, "model", None)
        labels = [getattr(model, "name", ""), "0"]
        queue = self._queue()
        queries, hits = prefix_cache(engine.stats_snapshot())
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             queue.get("running", 0)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             queue.get("waiting", 0)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             kv_cache_usage(queue)),
            ("vllm:gpu_prefix_cache_hit_rate", "Prefix cache hit rate (tokens hit / queried, "
             "since start).", hits / queries if queries else 0.0),
        )  # fmt: skip
        for name, help_, value in gauges:
            g = GaugeMetricFamily(name, help_, labels=LABELS)
            g.add_metric(labels, value)
            yield g
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", hits),
        )  # fmt: skip
        for name, help_, value in counters:
            c = CounterMetricFamily(name, help_, labels=LABELS)
            c.add_metric(labels, value)
            yield c


# The KV event publisher's counters (``server.kv_events``) -> help; the rest are gauges.
_EVENT_COUNTERS = {
    "batches": "KV event batches published.",
    "events": "KV events published (BlockStored, BlockRemoved, AllBlocksCleared).",
    "queue_drops": "KV event notifications dropped at the publisher's full queue "
    "(server.kv_events_queue): a router then misses those blocks.",
    "send_drops": "KV event batches a slow subscriber refused (kept for replay).",
    "replays": "KV event replay requests answered.",
    "errors": "KV event notifications that failed (logged, skipped).",
    "forgotten": "Chunks the publisher stopped tracking for room (server.kv_events_chunks); "
    "their BlockRemoved events were sent.",
    "startup_announced": "Chunks the disk tier held at start-up, announced (BlockStored, DISK).",
    "startup_unchained": "Disk entries read at start-up but not announced: their prefix chain "
    "back to position 0 is not on the disk.",
}
_EVENT_GAUGES = {
    "queued": "KV event notifications waiting for the publisher thread.",
    "chunks": "Chunks announced to routers and tracked for their removal.",
}


class EventsCollector(Collector):
    """``kvfuse_kv_events_*``: what the KV event publisher sent and dropped (when it runs)."""

    def __init__(self, events_getter: Callable[[], object | None]):
        self._events = events_getter

    def collect(self) -> Iterator[Metric]:
        events = self._events()
        if events is None:
            return
        c = events.counters()
        for name, help_ in _EVENT_COUNTERS.items():
            yield CounterMetricFamily(f"kvfuse_kv_events_{name}", help_, value=c.get(name, 0))
        for name, help_ in _EVENT_GAUGES.items():
            yield GaugeMetricFamily(f"kvfuse_kv_events_{name}", help_, value=c.get(name, 0))
