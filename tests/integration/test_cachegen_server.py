"""CacheGen through a real ``kvfuse serve`` process and the official ``openai`` client: entries
written with CacheGen on disk (raw in memory), read back after a restart, streamed within a
per-request ``kv_slo_ms``, reported in ``usage`` and ``/metrics``; bad budgets are 4xx."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from kvfuse_helpers import long_text
from openai import BadRequestError, OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
PROMPT = long_text(10) + "\n\nQuestion: Who built the lighthouse of Velmora?\nAnswer:"


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


def start(home: Path, disk: Path) -> ServerProcess:
    return ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {
                "disk_path": str(disk),
                "disk_codec": "cachegen",
                "stream_levels": [1, 3],
                "history": False,
                "prefetch": False,
            },
        },
    ).start()  # a queued request's chunks are otherwise read into memory before it runs


def client_of(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def metrics(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


def test_cachegen_entries_survive_a_restart_and_stream_within_a_budget(home, tmp_path):
    disk = tmp_path / "kv"
    first = start(home, disk)
    try:
        r = client_of(first).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
        )
        whole = (r.usage.prompt_tokens // 256) * 256
        assert whole >= 512 and r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        first.close()  # flushes the CacheGen writes to disk
    second = start(home, disk)
    try:
        client = client_of(second)
        streamed = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"kv_slo_ms": 60000}
        )
        details = streamed.usage.prompt_tokens_details
        assert details.cached_tokens == whole
        stream = details.model_extra["kv_stream"]
        assert (
            sum(stream["chunks"].values()) == whole // 256
            and stream["slo_ms"] == 60000
            and stream["met"]
        )
        assert (
            set(stream["chunks"]) <= {"cachegen.1", "cachegen.2", "cachegen.3"}
            and stream["bytes_read"] > 0
        )
        # The same prompt again: its chunks are in memory now (promoted), nothing to stream.
        again = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"kv_slo_ms": 60000}
        )
        assert again.usage.prompt_tokens_details.model_extra.get("kv_stream") is None
        text = metrics(second)
        assert re.search(r"^kvfuse_stream_requests_total 1\.0$", text, re.M), text
        assert re.search(
            r'^kvfuse_stream_chunks_total\{encoding="cachegen\.[123]"\} [1-9]', text, re.M
        )
        for bad in (0, -5, "fast"):
            with pytest.raises(BadRequestError) as e:
                client.completions.create(
                    model=MODEL, prompt="Hi", max_tokens=1, extra_body={"kv_slo_ms": bad}
                )
            assert "kv_slo_ms" in str(e.value)
    finally:
        second.close()
