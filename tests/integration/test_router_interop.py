"""kvfuse's KV events read by real consumers: vLLM's own ``kv_events`` classes (in vLLM's venv,
``bash bench/setup_vllm.sh``; ``$KVFUSE_VLLM_PYTHON``) and vllm-router's ``kv_aware`` policy in
front of two kvfuse servers (``bash bench/setup_router.sh``; ``$KVFUSE_VLLM_ROUTER``). Each test
is skipped, saying what to install, where its consumer is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model, free_port
from kvfuse_testkit.consumers import consumer, events_server, wait_ready

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
VLLM_PYTHON = os.environ.get("KVFUSE_VLLM_PYTHON", str(REPO / ".baselines/vllm-venv/bin/python"))
ROUTER = os.environ.get("KVFUSE_VLLM_ROUTER", str(REPO / ".baselines/router-venv/bin/vllm-router"))
SYSTEM = "You answer questions about the Eddystone lighthouse, its keepers and its history. " * 40
OTHER = "You are a ship's engineer; you answer questions about steam engines and boilers. " * 40

# Run by vLLM's interpreter: subscribe, decode every batch with vLLM's KVEventBatch, re-encode
# it with vLLM's encoder and compare the bytes, until AllBlocksCleared; print a JSON summary.
DECODER = r"""
import json, sys, time, collections
import msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
time.sleep(0.5)
print("ready", flush=True)
dec, enc = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
kinds, same, batches, seqs, done = collections.Counter(), True, 0, [], False
deadline = time.monotonic() + float(sys.argv[2])
while not done and time.monotonic() < deadline:
    if not sub.poll(200):
        continue
    topic, seq, payload = sub.recv_multipart()
    batch = dec.decode(payload)
    same = same and enc.encode(batch) == payload
    batches += 1
    seqs.append(int.from_bytes(seq, "big"))
    for e in batch.events:
        kinds[type(e).__name__] += 1
        done = done or isinstance(e, AllBlocksCleared)
print(json.dumps({"kinds": kinds, "same_bytes": same, "batches": batches, "seqs": seqs}))
"""


def _vllm_python() -> str:
    return consumer(VLLM_PYTHON, "vLLM venv", "bench/setup_vllm.sh", "KVFUSE_VLLM_PYTHON")


def _router() -> str:
    return consumer(ROUTER, "vllm-router", "bench/setup_router.sh", "KVFUSE_VLLM_ROUTER")


def _server(home, tmp_path, name) -> ServerProcess:
    return events_server(home, tmp_path, name, MODEL)


def test_vllms_own_classes_decode_every_batch(kvfuse_home, tmp_path):
    python = _vllm_python()
    ensure_model(kvfuse_home, MODEL)
    with _server(kvfuse_home, tmp_path, "a") as srv:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's own packages
        child = subprocess.Popen(
            [python, "-c", DECODER, srv.events_url, "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            client = OpenAI(base_url=srv.base_url, api_key="x")
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            srv_flush(srv)
            assert httpx.delete(srv.url + "/v1/kv").status_code == 200
            out, _ = child.communicate(timeout=150)
        finally:
            child.kill()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["same_bytes"], "vLLM's encoder gives other bytes for what it decoded"
    kinds = summary["kinds"]
    assert kinds["BlockStored"] >= 2 and kinds["AllBlocksCleared"] == 1
    assert kinds.get("BlockRemoved", 0) >= 1
    assert summary["seqs"] == list(range(summary["batches"]))  # every batch, no gap


def srv_flush(srv: ServerProcess, timeout: float = 30.0) -> None:
    """Wait until the server's lower-tier writes are done (their events sent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(srv.url + "/v1/kv/stats").json()
        store = stats["tiers"].get("store", {})
        if not store.get("queue_depth", 0) and not stats["engine"].get("saver", {}).get("pending"):
            return
        time.sleep(0.2)


def _chats(srv: ServerProcess) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvfuse_http_requests_total") and "/v1/chat/completions" in line
    )


def test_kv_aware_routes_a_prefix_to_the_server_holding_it(kvfuse_home, tmp_path):
    router = _router()
    ensure_model(kvfuse_home, MODEL)
    a, b = _server(kvfuse_home, tmp_path, "a"), _server(kvfuse_home, tmp_path, "b")
    port = free_port()
    log = open(tmp_path / "router.log", "wb")
    with a, b:
        cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
               "--worker-urls", a.url, b.url, "--kv-event-block-size", "16",
               "--kv-event-model", MODEL,
               "--kv-event-source", f"{a.url}={a.events_url}",
               "--kv-event-source", f"{b.url}={b.events_url}"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc, tmp_path / "router.log",
                       "vllm-router")  # fmt: skip
            # each server holds one long system prompt (sent to it directly)
            for srv, system in ((a, SYSTEM), (b, OTHER)):
                OpenAI(base_url=srv.base_url, api_key="x").chat.completions.create(
                    model=MODEL, messages=_ask(system, "Hi"), max_tokens=2
                )
                srv_flush(srv)
            time.sleep(1.0)  # the router reads the events
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            routed = []
            for system, q in [(SYSTEM, "Who built it?"), (OTHER, "Who fixed it?"),
                              (OTHER, "When?"), (SYSTEM, "How tall is it?"),
                              (SYSTEM, "Is it open?"), (OTHER, "Why?")]:  # fmt: skip
                before = (_chats(a), _chats(b))
                client.chat.completions.create(model=MODEL, messages=_ask(system, q), max_tokens=2)
                after = (_chats(a), _chats(b))
                routed.append("a" if after[0] > before[0] else "b" if after[1] > before[1] else "?")
        finally:
            proc.terminate()
            proc.wait(10)
    want = ["a", "b", "b", "a", "a", "b"]
    assert routed == want, f"{routed}: {(tmp_path / 'router.log').read_text()[-3000:]}"


def _ask(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
