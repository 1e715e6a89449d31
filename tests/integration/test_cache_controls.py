"""Prompt-cache controls on real SmolLM2 KV: retention (entries gone after a short retention, kept on
disk through memory pressure with a long one, in_memory never written below memory; reuse
extends the expiry), driven by an injected clock; and a cache breakpoint in the middle of a chunk,
through a real server and the ``openai`` client, reported as cached tokens up to the breakpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfuse_helpers import load_builtin, long_text
from openai import OpenAI

from kvfuse.config import load_config
from kvfuse.engine import CacheOptions, Retention
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import prefix_keys
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_900_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup(kvfuse_home, tmp_path):
    """An engine on SmolLM2 with a memory tier of ~3 entries and a disk tier, on a test clock."""
    from kvfuse.runtime import open_engine

    ensure_model(kvfuse_home, MODEL)
    config = load_config(
        overrides={
            "home": str(kvfuse_home),
            "model": MODEL,
            "cache.disk_path": str(tmp_path / "kv"),
            "cache.memory_bytes": 7 * 256 * 23040 // 2,
            "cache.history": False,  # 3.5 chunks
            "cache.async_save": False,
            "cache.prefetch": False,
        }
    )
    clock = Clock()
    engine = open_engine(config, model=load_builtin(MODEL), clock=clock)
    yield engine, clock
    engine.close()


def prompt(engine, tag: int) -> list[int]:
    ids = engine.prompts.encode_prompt(f"Document {tag}. " + long_text(8))
    assert len(ids) > 2 * 256 + 10
    return ids[: 2 * 256 + 10]  # two whole chunks and a few tokens


def where(engine, ids) -> list[tuple]:
    """For each whole chunk of ``ids``: which tiers hold it."""
    keys = prefix_keys(ids, engine.settings.cache.chunk_size, engine.namespace())
    engine.cache.store.flush()
    return [tuple(t.name for t in engine.cache.store.tiers if t.contains(k)) for k in keys]


def test_a_short_retention_is_gone_after_it(setup):
    engine, clock = setup
    ids = prompt(engine, 1)
    engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(ttl_s=60)))
    assert where(engine, ids) == [("memory", "disk")] * 2
    clock.t += 59
    assert engine.generate(ids, GREEDY).cached_tokens == 512
    clock.t += 2
    assert where(engine, ids) == [(), ()]
    stats = engine.cache_stats()
    assert stats["memory"]["expired"] >= 2 and stats["disk"]["expired"] >= 2
    assert engine.generate(ids, GREEDY).cached_tokens == 0


def test_a_long_retention_survives_memory_pressure_on_disk(setup):
    engine, clock = setup
    ids = prompt(engine, 2)
    engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(ttl_s=24 * 3600)))
    for tag in (3, 4, 5):  # other prompts push it out of the memory tier
        engine.generate(prompt(engine, tag), GREEDY)
    assert where(engine, ids) == [("disk",)] * 2
    clock.t += 23 * 3600
    r = engine.generate(ids, GREEDY)
    assert r.cached_tokens == 512 and set(r.hit_tiers) == {"disk"}
    clock.t += 2 * 3600
    assert where(engine, ids) == [(), ()]


def test_in_memory_retention_never_reaches_disk(setup):
    engine, _ = setup
    ids = prompt(engine, 6)
    engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(memory_only=True)))
    assert where(engine, ids) == [("memory",)] * 2
    for tag in (7, 8, 9):
        engine.generate(prompt(engine, tag), GREEDY)
    assert where(engine, ids) == [(), ()]  # evicted from memory: gone, as in_memory promises


def test_reuse_extends_the_expiry_never_shortens_it(setup):
    engine, clock = setup
    ids = prompt(engine, 10)
    engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(ttl_s=60)))
    r = engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(ttl_s=3600)))
    assert r.cached_tokens == 512
    # does not shorten it
    engine.generate(ids, GREEDY, cache=CacheOptions(retention=Retention(ttl_s=30)))
    clock.t += 600
    assert where(engine, ids) == [("memory", "disk")] * 2
    clock.t += 3001
    assert where(engine, ids) == [(), ()]


# ------------------------------------------------------------------------- breakpoints (server)

DOC = "Reference notes. " + long_text(3)


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    tmp = tmp_path_factory.mktemp("breakpoints")
    # history off: only chunks and breakpoint entries can be reused, so the counts are exact
    srv = ServerProcess(
        kvfuse_home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(tmp / "kv"), "history": False},
            "responses": {"path": str(tmp / "r.sqlite3")},
        },
    )
    srv.start()
    yield srv
    srv.close()


def expected_breakpoint(home: Path, messages: list[dict]) -> int:
    """Tokens of the rendered chat wholly before the end of DOC (computed here from the template)."""
    from kvfuse.models import registry
    from kvfuse.models.tokenizer import Tokenizer

    tok = Tokenizer(registry.converted_dir(home, MODEL))
    text = tok.render_chat(
        [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else "\n".join(p["text"] for p in m["content"]),
            }
            for m in messages
        ]
    )
    end = text.index(DOC) + len(DOC)
    _, offsets = tok.encode_offsets(text, add_special_tokens=False)
    return sum(1 for _, stop in offsets if stop <= end)


def conversation(question: str, marked: bool) -> list[dict]:
    part = {"type": "text", "text": DOC}
    if marked:
        part["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    return [{"role": "system", "content": [part]}, {"role": "user", "content": question}]


def test_a_breakpoint_mid_chunk_is_reused_up_to_it(server, kvfuse_home):
    c = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    bp = expected_breakpoint(kvfuse_home, conversation("Q", True))
    assert bp % 256 and bp > 256, bp  # inside the second chunk

    def cached(question: str, marked: bool, salt: str) -> int:
        r = c.chat.completions.create(
            model=MODEL,
            messages=conversation(question, marked),
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("What is the first fact?", True, "marked") == 0
    assert cached("Which paragraph is longest?", True, "marked") == bp
    # the same without the breakpoint: only the whole chunk is reused
    assert cached("What is the first fact?", False, "plain") == 0
    assert cached("Which paragraph is longest?", False, "plain") == 256
    # the Responses API takes the same marks on input_text parts
    r = c.responses.create(
        model=MODEL,
        input=[
            {
                "role": "system",
                "content": [
                    {"type": "input_text", "text": DOC, "cache_control": {"type": "ephemeral"}}
                ],
            },
            {"role": "user", "content": "Any third question?"},
        ],
        max_output_tokens=2,
        temperature=0,
        extra_body={"cache_salt": "marked"},
    )
    assert r.usage.input_tokens_details.cached_tokens == bp
