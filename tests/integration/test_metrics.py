"""GET /metrics: valid Prometheus text, and counters that move with the requests served."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    home = kvfuse_home
    ensure_model(home, MODEL)
    srv = ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(tmp_path_factory.mktemp("metrics-kv"))},
            "engine": {"release_idle_s": 0.5},  # the heap given back soon after each request
        },
    )
    srv.start()
    yield srv
    srv.close()


MB = 1 << 20


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value} (parsing fails on invalid text)."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_name_every_family(server):
    samples = scrape(server)
    names = {name for name, _ in samples}
    for expected in (
        "kvfuse_queue_depth",
        "kvfuse_requests_running",
        "kvfuse_generation_tokens_total",
        "kvfuse_tier_hits_total",
        "kvfuse_tier_misses_total",
        "kvfuse_tier_read_bytes_total",
        "kvfuse_tier_evictions_total",
        "kvfuse_tier_errors_total",
        "kvfuse_store_lookups_total",
        "kvfuse_time_to_first_token_seconds_count",
        "kvfuse_time_per_output_token_seconds_count",
    ):
        assert expected in names, expected
    assert ("kvfuse_prompt_tokens_total", (("source", "cached"),)) in samples
    assert ("kvfuse_tier_hits_total", (("tier", "memory"),)) in samples
    assert ("kvfuse_tier_hits_total", (("tier", "disk"),)) in samples


def test_the_cpu_backend_is_an_info_gauge(server):
    """The CPU path chosen at load (``kernels: auto``): one series, its labels naming the choice."""
    info = [labels for name, labels in scrape(server) if name == "kvfuse_cpu_backend_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels["kernels"] in ("on", "off")
    # weights: auto on the built-in GGUF model: its own blocks (or float32 without the kernels)
    assert labels["weights"] in ("ggml", "plain", "onednn-fp32")
    assert labels["isa"] in ("avx512", "avx2", "none")
    assert value(scrape(server), "kvfuse_cpu_backend_info", **labels) == 1
    from kvfuse.models.cpu import kernels

    cpu = [dict(labels) for name, labels in scrape(server) if name == "kvfuse_cpu_info"]
    assert len(cpu) == 1 and cpu[0]["model"] == (kernels.cpu_model() or "")
    features = cpu[0]["features"].split()
    assert features == [f for f in kernels.LISTED if f in kernels.cpu_flags()]
    if labels["isa"] != "none":  # the kernels' choice follows from the features listed
        assert kernels.isa_for(set(features) | {"avx"}) == labels["isa"]


def test_memory_gauges_name_the_resident_size_and_the_weights(server):
    samples = scrape(server)
    rss, weights = (
        value(samples, n) for n in ("kvfuse_resident_memory_bytes", "kvfuse_weights_bytes")
    )
    # the built-in model's weights as loaded, inside a process that holds them and more
    assert 10 * MB < weights < rss


def test_the_idle_engine_gives_the_heap_back(server):
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    before = value(scrape(server), "kvfuse_heap_releases_total")
    client.completions.create(model=MODEL, prompt="Heap " * 300, max_tokens=2)
    deadline = time.monotonic() + 15  # 0.5 s idle, and the loop looks at least once a second
    while time.monotonic() < deadline:
        samples = scrape(server)
        if value(samples, "kvfuse_heap_releases_total") > before:
            break
        time.sleep(0.2)
    released = value(samples, "kvfuse_heap_releases_total")
    assert released > before and value(samples, "kvfuse_heap_released_bytes_total") > 0
    time.sleep(1.5)  # still idle: no second release until the engine works again
    assert value(scrape(server), "kvfuse_heap_releases_total") == released


def test_counters_move_with_requests(server):
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    prompt = " ".join(f"Step {i}: add {i} to the total." for i in range(45)) + "\nThe total is"
    before = scrape(server)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    second = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    third = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    cached = third.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvfuse_http_requests_total", endpoint="/v1/completions", status="200") == 2
    assert delta("kvfuse_http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("kvfuse_engine_requests_total") == 3
    assert delta("kvfuse_prompt_tokens_total", source="cached") == cached
    prompt_total = (
        first.usage.prompt_tokens + second.usage.prompt_tokens + third.usage.prompt_tokens
    )
    assert delta("kvfuse_prompt_tokens_total", source="prefilled") == prompt_total - cached
    assert delta("kvfuse_generation_tokens_total") == sum(
        r.usage.completion_tokens for r in (first, second, third)
    )
    # one hit per reused entry: the prompt's whole chunks, and the first request's kept history after them
    entries = -(-third.usage.prompt_tokens // 256)
    assert cached == third.usage.prompt_tokens - 1
    assert delta("kvfuse_tier_hits_total", tier="memory") == entries
    assert delta("kvfuse_reused_chunks_total", tier="memory") == entries
    assert (
        delta("kvfuse_history_requests_total") >= 1
        and delta("kvfuse_history_reused_tokens_total") > 0
    )
    assert delta("kvfuse_time_to_first_token_seconds_count") == 3
    assert delta("kvfuse_time_to_first_token_seconds_sum") > 0
    assert delta("kvfuse_time_per_output_token_seconds_count") >= 2
    assert delta("kvfuse_tier_puts_total", tier="memory") >= 1

    # a 400 is counted under its status
    httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": ""})
    assert (
        delta_after(
            server, after, "kvfuse_http_requests_total", endpoint="/v1/completions", status="400"
        )
        == 1
    )


def delta_after(server, before, name, **labels) -> float:
    return value(scrape(server), name, **labels) - value(before, name, **labels)
