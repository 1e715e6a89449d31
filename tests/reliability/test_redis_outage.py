"""A real redis-server dying and coming back under SmolLM2 generations; two engine processes sharing it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvfuse_helpers import load_builtin, long_text, model_home

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier, RedisTier

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BACKOFF = 0.5
HELPERS = Path(__file__).resolve().parents[1] / "kvfuse_helpers.py"


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin("smollm2")


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[str, list[int]]:
    """Two prompts of two whole 256-token chunks and a tail, and their cache-free greedy output."""
    out = {}
    for name, question in (("a", "Who built the lighthouse?"), ("b", "Where do puffins nest?")):
        ids = smollm2.tokenizer.encode(
            long_text(5 if name == "a" else 6) + f"\n\nQuestion: {question}\nAnswer:"
        )
        assert 512 < len(ids) < 768
        out[name] = ids
    return out


@pytest.fixture(scope="module")
def expected(smollm2, prompts) -> dict[str, list[int]]:
    engine = Engine(smollm2, None)
    return {name: engine.generate(ids, GREEDY).token_ids for name, ids in prompts.items()}


def test_generations_survive_a_redis_outage_and_hit_again_after_it(
    smollm2, prompts, expected, redis_server
):
    redis = RedisTier(redis_server.url, timeout_s=0.3, backoff_s=BACKOFF)
    store = TieredStore(MemoryTier(1), [redis])  # memory holds nothing: every hit comes from Redis
    # chunk-level reuse: what this test pins down
    engine = Engine(smollm2, store, EngineSettings.of(history=False))
    try:

        def run(name: str, **kw):
            result = engine.generate(prompts[name], GREEDY, **kw)
            assert result.token_ids == expected[name], f"wrong output for prompt {name}"
            return result

        assert run("a").stored_chunks == 2
        engine.flush()
        assert run("a").hit_tiers == ("redis", "redis")

        # the server is killed in the middle of a generation (while it streams its answer)
        def kill_on_first_piece(piece: str) -> None:
            if redis_server.proc is not None:
                redis_server.stop()

        run("b", on_text=kill_on_first_piece)
        assert redis_server.proc is None
        engine.flush()
        before = redis.stats.snapshot()
        for name in ("a", "b"):
            assert run(name).cached_tokens == 0
            engine.flush()
            # let the back-off end, so the next call tries the dead server again
            time.sleep(BACKOFF)
        after = redis.stats.snapshot()
        assert after["errors"] > before["errors"]
        assert after["dropped_writes"] > before["dropped_writes"]
        assert redis.is_backing_off() or not redis.ping()

        redis_server.start()  # same port, empty (no persistence)
        time.sleep(BACKOFF + 0.1)
        for attempt in range(3):
            run("a")  # stores its chunks again once the server answers
            engine.flush()
            if run("a").hit_tiers == ("redis", "redis"):
                break
            time.sleep(BACKOFF)
        else:
            pytest.fail(f"no Redis hits after the server came back: {redis.stats.snapshot()}")
        assert attempt == 0, (
            "the first generation after the back-off should already reach the server"
        )
    finally:
        store.close()


def _engine_process(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HELPERS), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_chunks_through_redis(
    smollm2, prompts, expected, redis_server, tmp_path
):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(map(str, prompts["a"])))
    args = [
        "--home",
        str(model_home()),
        "--redis-url",
        redis_server.url,
        "--prompt-file",
        str(prompt_file),
        "--max-tokens",
        str(GREEDY.max_tokens),
    ]
    a = _engine_process(args)
    assert (a["cached_tokens"], a["stored_chunks"]) == (
        0,
        3,
    )  # two whole chunks and the history's tail
    assert a["token_ids"] == expected["a"]
    b = _engine_process(args)  # another process: its memory tier is empty
    assert b["cached_tokens"] == 512 and b["hit_tiers"] == ["redis", "redis"]
    assert b["token_ids"] == expected["a"]
