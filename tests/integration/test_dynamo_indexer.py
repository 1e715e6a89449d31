"""kvfuse's KV events read by Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from
PyPI ``ai-dynamo-runtime``, in its own venv: ``bash bench/setup_dynamo.sh``;
``$KVFUSE_DYNAMO_PYTHON``). It subscribes to two kvfuse servers' streams, keeps a radix tree of
their blocks and answers ``POST /query`` with each worker's longest match in tokens, per tier
(``gpu``, ``cpu``: kvfuse's medium ``CPU``, read as host memory; ``disk``: ``DISK``), hashing the
query's token ids itself: so a match proves it decoded kvfuse's batches, chained the blocks by
their parent hashes and read their token ids. Skipped, saying what to install, without it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvfuse_testkit import ensure_model, free_port
from kvfuse_testkit.consumers import consumer, events_server, wait_ready

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
PYTHON = os.environ.get("KVFUSE_DYNAMO_PYTHON", str(REPO / ".baselines/dynamo-venv/bin/python"))
SYSTEM = "You answer questions about the Bell Rock lighthouse, its keepers and its history. " * 40
OTHER = "You are a canal lock keeper; you answer questions about barges and their cargo. " * 40


def _python() -> str:
    return consumer(PYTHON, "Dynamo venv", "bench/setup_dynamo.sh", "KVFUSE_DYNAMO_PYTHON")


def _scores(url: str, ids: list[int]) -> dict[int, dict]:
    """Per worker (instance id): its longest match for ``ids`` in tokens, overall
    (``longest_matched``) and per tier (``gpu``, ``cpu``, ``disk``). Dynamo 1.6's answer; its
    ``scores`` field counts the device tier only, which kvfuse never announces."""
    r = httpx.post(url + "/query", json={"token_ids": ids, "model_name": MODEL}, timeout=10)
    assert r.status_code == 200, r.text
    return {int(w): m for w, m in r.json()["instances"].items()}


def _matched(scores: dict[int, dict], worker: int, tier: str = "longest_matched") -> int:
    return scores.get(worker, {}).get(tier, 0)


def _wait_scores(url: str, ids: list[int], until, timeout: float = 30.0) -> dict[int, dict]:
    """Poll the indexer until ``until(scores)`` holds (events travel asynchronously)."""
    deadline = time.monotonic() + timeout
    scores = _scores(url, ids)
    while not until(scores) and time.monotonic() < deadline:
        time.sleep(0.3)
        scores = _scores(url, ids)
    return scores


def _ask(system: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]


def test_dynamos_indexer_finds_each_prefix_on_the_server_holding_it(kvfuse_home, tmp_path):
    python = _python()
    ensure_model(kvfuse_home, MODEL)
    a, b = (events_server(kvfuse_home, tmp_path, n, MODEL) for n in "ab")
    url, log_path = f"http://127.0.0.1:{free_port()}", tmp_path / "indexer.log"
    with a, b, open(log_path, "wb") as log:
        workers = f"1={a.events_url},2={b.events_url}"
        cmd = [python, "-m", "dynamo.indexer", "--port", url.rsplit(":", 1)[1], "--threads", "1",
               "--block-size", "16", "--model-name", MODEL, "--workers", workers]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(url + "/workers", proc, log_path, "the Dynamo indexer")
            time.sleep(1.0)  # its subscriptions reach the publishers before the first event
            ids = {}
            for srv, system in ((a, SYSTEM), (b, OTHER)):
                msgs = _ask(system)
                ids[system] = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()[
                    "tokens"
                ]
                OpenAI(base_url=srv.base_url, api_key="x").chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=2
                )
            whole = {s: len(t) // 256 * 256 for s, t in ids.items()}  # the full chunks, at least
            on_a = _wait_scores(url, ids[SYSTEM], lambda s: _matched(s, 1, "disk") >= whole[SYSTEM])
            on_b = _wait_scores(url, ids[OTHER], lambda s: _matched(s, 2, "disk") >= whole[OTHER])
            # a clear of everything on a (AllBlocksCleared) empties a's tree, not b's
            assert httpx.delete(a.url + "/v1/kv").status_code == 200
            cleared = _wait_scores(url, ids[SYSTEM], lambda s: not _matched(s, 1))
            kept = _scores(url, ids[OTHER])
        finally:
            proc.terminate()
            proc.wait(10)
    story = log_path.read_text()[-3000:]
    assert whole[SYSTEM] >= 512 and whole[OTHER] >= 512
    for scores, mine, other, system in ((on_a, 1, 2, SYSTEM), (on_b, 2, 1, OTHER)):
        for tier in ("longest_matched", "cpu", "disk"):
            assert _matched(scores, mine, tier) >= whole[system], (tier, scores, story)
        assert not _matched(scores, mine, "gpu") and not _matched(scores, other), (scores, story)
    assert not _matched(cleared, 1), (cleared, story)
    assert _matched(kept, 2) >= whole[OTHER], (kept, story)
