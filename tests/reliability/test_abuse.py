"""Abuse of a real ``kvfuse serve`` (issue 39): request sequences that used to wedge the engine,
grow state without bound or cost the whole server, each against a real server process.

Every test asserts a bounded response time (a generous bound: ``BOUND_S``, many times a normal
request here), a clear 4xx where the input is refused, and another tenant's request still served
meanwhile. The times measured are printed (``-s``) and quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
BOUND_S = 60.0  # a normal short request takes well under a second here; a wedge never answers


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


def start(home: Path, tmp: Path, config: dict | None = None, **kw) -> ServerProcess:
    config = dict(config or {})
    cache = {"disk_path": str(tmp / "kv"), **config.pop("cache", {})}
    return ServerProcess(home, config={"model": MODEL, "cache": cache, **config}, **kw).start()


def client(srv: ServerProcess, key: str = "unused", timeout: float = BOUND_S) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=timeout)


def timed(fn, *args, **kw):
    """``(result or exception, seconds)``."""
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the caller asserts on what it was
        out = e
    return out, time.perf_counter() - t0


def bystander(srv: ServerProcess, key: str = "unused", salt: str = "bystander") -> float:
    """Another tenant's short request: its time to answer (it must be answered)."""
    r, dt = timed(
        client(srv, key).completions.create,
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": salt},
    )
    assert not isinstance(r, Exception), f"a bystander's request failed: {r!r}"
    print(f"  bystander answered in {dt:.2f} s")
    return dt


def tokenizer(home: Path) -> Tokenizer:
    return Tokenizer.from_file(str(home / "models" / MODEL / "tokenizer.json"))


def slot_bytes(home: Path, kv_bytes: int = 2) -> int:
    """Live KV bytes per token of ``MODEL`` in fp16 (``models.cache.slot_bytes``)."""
    c = json.loads((home / "models" / MODEL / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * kv_bytes + 8


# ------------------------------------------------------------------------------ item 5

NOTE = (
    "here is a note about the museums of paris and rome and the rivers that run through "
    "them and the bridges that cross the rivers at every turn of the old town"
)


def test_an_alignment_longer_than_the_kv_budget_never_wedges_admission(home, tmp_path):
    """A history stored letter by letter (one token per character) lines up with a later prompt
    of the same text tokenized normally: the prompt that would run is the stored ids, several
    times longer, and beyond the whole KV budget. It used to pass the budget check (made before
    the alignment), never be admitted, and block admission for everyone behind it."""
    tok = tokenizer(home)
    spelled = [tok.token_to_id("Ġ" if c == " " else c) for c in NOTE]
    assert None not in spelled
    tail = " and what about the churches and the squares of both cities, which is older?"
    text = NOTE + tail
    canonical = len(tok.encode(text).ids)
    budget_slots = len(spelled) + 4 + 8  # the spelled history fits; it plus the tail does not
    assert canonical + 4 < budget_slots < len(spelled) + len(tok.encode(tail).ids) + 4
    srv = start(home, tmp_path, {"engine": {"kv_memory_bytes": budget_slots * slot_bytes(home)}})
    try:
        c = client(srv)
        extra = {"cache_salt": "item5", "prompt_cache_key": "note"}
        first, t_first = timed(
            c.completions.create,
            model=MODEL,
            prompt=spelled,
            max_tokens=4,
            temperature=0,
            extra_body=extra,
        )
        assert first.usage.prompt_tokens == len(spelled)
        with ThreadPoolExecutor(2) as pool:
            aligned = pool.submit(
                timed,
                c.completions.create,
                model=MODEL,
                prompt=text,
                max_tokens=4,
                temperature=0,
                extra_body=extra,
            )
            time.sleep(0.5)  # queued first: a wedge would hold the bystander behind it
            other = pool.submit(timed, bystander, srv)
            (r, dt), (_, dt_other) = aligned.result(), other.result()
        print(f"  normal {t_first:.2f} s; aligned-too-long {dt:.2f} s; bystander {dt_other:.2f} s")
        assert not isinstance(r, Exception), f"the request failed: {r!r}"
        # served as sent (the alignment would not fit), in bounded time
        assert r.usage.prompt_tokens == canonical and dt < BOUND_S
    finally:
        srv.close()
