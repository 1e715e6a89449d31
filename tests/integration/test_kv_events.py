"""``kvfuse serve --kv-events``: a real server's KV event stream, read with a ZMQ SUB socket and
decoded with msgspec as a router does; its blocks' tokens are the prompt's, its chain is whole, a
clear retracts everything, the replay socket gives the stream back."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model, free_port

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvfuse.events.wire import END_SEQ, decode_batch  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "smollm2"
TOPIC = "kv@test@smollm2"
LONG = [{"role": "user", "content": "Describe the lighthouse keeper's day, hour by hour. " * 60}]


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    port, replay = free_port(), free_port()
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path_factory.mktemp("events-kv"))},
        "server": {"kv_events_replay": f"tcp://127.0.0.1:{replay}", "kv_events_topic": TOPIC},
    }
    srv = ServerProcess(kvfuse_home, config=config, args=["--kv-events", f"tcp://127.0.0.1:{port}"])
    srv.start()
    srv.events_url, srv.replay_url = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    yield srv
    srv.close()


@pytest.fixture()
def sub(server):
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(server.events_url)
    time.sleep(0.5)  # the subscription reaches the publisher before the first event
    yield s
    ctx.destroy(linger=0)


def collect(sub, until, timeout=30.0) -> list:
    """(seq, event) pairs received until ``until(events)`` holds (or the timeout passes)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until([e for _, e in got]):
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            got += [(int.from_bytes(seq, "big"), e) for e in decode_batch(payload).events]
    return got


def stored(events, medium):
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def test_a_prompt_announces_its_blocks_in_memory_then_on_disk(server, sub):
    ids = httpx.post(server.url + "/tokenize", json={"messages": LONG}).json()["tokens"]
    full = len(ids) // 256
    assert full >= 2
    client = OpenAI(base_url=server.base_url, api_key="x")
    client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=4)
    got = collect(sub, lambda ev: len(stored(ev, "DISK")) >= full)
    events = [e for _, e in got]
    cpu = stored(events, "CPU")
    assert len(cpu) >= full and len(stored(events, "DISK")) >= full
    chain = [e for e in cpu if len(e.token_ids) == 256][:full]
    assert chain[0].parent_block_hash is None
    for before, after in zip(chain, chain[1:]):
        assert after.parent_block_hash == before.block_hashes[-1]
    assert [t for e in chain for t in e.token_ids] == ids[: full * 256]
    for e in chain:
        assert e.block_size == 16 and len(e.block_hashes) == 16
        assert len(set(e.extra_keys)) == 1 and e.lora_id is None
    seqs = sorted({s for s, _ in got})
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps


def test_a_prompts_last_blocks_are_announced_before_its_answer_ends(server, sub):
    """A router sees a conversation's partial last chunk from its prefill on (saved in memory
    then), not only once the turn's history is saved after the answer: a client's next turn can
    reach the router before that (cache_writer.prompt_tail)."""
    # text of its own, never periodic: no other block (LONG's late tail, this prompt's whole
    # chunks) may start with the tail's first block
    crossings = " ".join(f"Crossing {i} carried {i * 7 % 13} travellers." for i in range(90))
    messages = [{"role": "user", "content": "Tell of the ferryman's night. " + crossings}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    start, n = len(ids) // 256 * 256, len(ids)
    assert n - start >= 16  # a whole block past the last full chunk
    client = OpenAI(base_url=server.base_url, api_key="x")
    # ignore_eos: the answer's length may not depend on where this CPU's greedy path ends
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == 40  # the turn's tail has blocks the prompt's lacks

    def tails(events):
        return [e for e in stored(events, "CPU") if e.token_ids[:16] == ids[start : start + 16]]

    got = collect(sub, lambda ev: len(tails(ev)) >= 2)
    by_seq = [(seq, e) for seq, e in got if e in tails([e])]
    (prompt_seq, prompt_tail), (turn_seq, turn_tail) = by_seq[:2]
    assert prompt_tail.token_ids == ids[start : start + (n - start) // 16 * 16]
    assert len(turn_tail.token_ids) > len(prompt_tail.token_ids) and prompt_seq <= turn_seq
    assert turn_tail.block_hashes[: len(prompt_tail.block_hashes)] == prompt_tail.block_hashes


def test_clear_retracts_and_metrics_count(server, sub):
    client = OpenAI(base_url=server.base_url, api_key="x")
    client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=2)
    assert httpx.delete(server.url + "/v1/kv").status_code == 200
    got = collect(sub, lambda ev: any(type(e).__name__ == "AllBlocksCleared" for e in ev))
    assert any(type(e).__name__ == "AllBlocksCleared" for _, e in got)
    text = httpx.get(server.url + "/metrics").text
    sent = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvfuse_kv_events_events_total")
    )
    assert sent > 0 and "kvfuse_kv_events_queue_drops_total 0.0" in text


def test_replay_gives_the_stream_back(server):
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(server.replay_url)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == TOPIC.encode() and decode_batch(payload).events
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs and seqs == list(range(len(seqs)))
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow  # two servers of its own, one after the other
def test_a_restarted_server_announces_what_its_disk_holds(kvfuse_home, tmp_path):
    """The entries a server wrote to its disk tier are announced again (BlockStored, DISK, the
    same hashes) by the server started next on the same disk, before any request."""
    ensure_model(kvfuse_home, MODEL)
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path / "kv")},
        "server": {"kv_events_topic": TOPIC},
    }
    ctx = zmq.Context()
    try:
        runs = []
        for run in range(2):
            port = free_port()
            with ServerProcess(
                kvfuse_home, config=config, args=["--kv-events", f"tcp://127.0.0.1:{port}"]
            ) as srv:
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.connect(f"tcp://127.0.0.1:{port}")
                time.sleep(0.5)
                if run == 0:
                    client = OpenAI(base_url=srv.base_url, api_key="x")
                    client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=4)
                got = collect(s, lambda ev: len(stored(ev, "DISK")) >= 2, timeout=60)
                got += collect(s, lambda ev: False, timeout=4)  # and whatever follows
                runs.append(stored([e for _, e in got], "DISK"))
                s.close(linger=0)
                if run == 0:  # the writes are done before the server stops
                    httpx.get(srv.url + "/v1/kv/stats", timeout=30)
                    time.sleep(1.0)
        first, second = ({tuple(e.block_hashes) for e in r} for r in runs)
        assert len(second) >= 2 and second == first
        assert all(e.medium == "DISK" and e.block_size == 16 for e in runs[1])
    finally:
        ctx.destroy(linger=0)
