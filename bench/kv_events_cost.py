"""What publishing KV events costs (issue 40's target: at most 2% of throughput at 16 clients).

One `kvfuse serve` at a time, alternately without and with `--kv-events` (a ZMQ SUB consumer
connected and draining, so that every batch is really encoded and sent), the order of the two
swapped every round; each pass runs the same requests with a fresh `cache_salt` (a cold cache, so
every pass stores and announces the same chunks): ShareGPT dev first messages (cut to
--chars) behind one shared system prompt of about two chunks, --clients concurrent streaming
clients. Per mode: the median over rounds of output tokens/s and requests/s; the cost is
1 - on / off. A server is restarted for each pass, so both modes start equally cold.

    python bench/kv_events_cost.py --smoke   # the plumbing: 4 clients, 8 requests, 1 round
    python bench/kv_events_cost.py           # 16 clients, 64 requests, 5 rounds (a quiet machine)

Results: docs/bench/kv_events_cost.json (kv_events_cost-quick with --smoke).
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib import results  # noqa: E402
from bench.lib.cli import parser  # noqa: E402
from bench.lib.client import Runner, Workload, warm_up  # noqa: E402
from bench.lib.paths import DATA, default_home  # noqa: E402
from bench.lib.rounds import feature_cost, order  # noqa: E402
from bench.serve import sharegpt_requests  # noqa: E402
from kvfuse_testkit import ServerProcess, ensure_model, free_port  # noqa: E402

SYSTEM = "You are a careful assistant for a shipping company; answer briefly and exactly. " * 30


def args_parser():
    p = parser(__doc__, "model", "home", ("rounds", {"default": 5}), "tag")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--chars", type=int, default=400, help="a ShareGPT message's characters")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="4 clients, 8 requests, 1 round")
    return p


class Drain:
    """A SUB socket reading every batch of ``endpoint`` on a thread of its own (a router's part)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


def one_pass(args, events: bool, wl: Workload, workdir: Path) -> dict:
    """A fresh server (with or without events), warmed up, then ``wl`` once; its figures."""
    port = free_port()
    extra = ["--kv-events", f"tcp://127.0.0.1:{port}"] if events else []
    config = {"model": args.model, "cache": {"disk_path": str(workdir / uuid.uuid4().hex)}}
    with ServerProcess(args.home, config=config, args=extra) as srv:
        drain = Drain(f"tcp://127.0.0.1:{port}") if events else None
        try:
            runner = Runner(srv.base_url, args.model, "kvfuse", ignore_eos=True)
            warm_up(runner, args.clients)
            p = runner.run(wl, args.clients, runner.extra(True, uuid.uuid4().hex))
        finally:
            batches = drain.batches if drain else 0
            if drain:
                drain.close()
    out_tokens = sum(s["completion_tokens"] or 0 for s in p.samples)
    return {"events": events, "req_s": len(p.samples) / p.wall_s, "out_tok_s": out_tokens / p.wall_s,
            "errors": len(p.errors), "batches": batches}  # fmt: skip


def cost(passes: list[dict]) -> dict:
    """Medians per mode, their min / max and the relative cost of events (1 - on / off) in both
    rates: ``rounds.feature_cost``."""
    return feature_cost(passes, "events", ("off", "on"))


def main() -> None:
    args = args_parser().parse_args()
    if args.smoke:
        args.clients, args.requests, args.rounds, args.max_tokens = 4, 8, 1, 4
    args.home = args.home or str(default_home())
    ensure_model(args.home, args.model)
    reqs = sharegpt_requests(DATA / "sharegpt_multiturn_dev.jsonl", args.requests, args.chars)
    for r in reqs:
        r.messages = [{"role": "system", "content": SYSTEM}, *r.messages]
    wl = Workload("sharegpt-shared-system", reqs, args.max_tokens, "sharegpt dev")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvfuse-bench-events-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    passes = []
    for r in range(args.rounds):
        for events in order([False, True], r, alternate=True):
            passes.append(one_pass(args, events, wl, workdir))
            print(f"round {r} events={'on ' if events else 'off'} {passes[-1]}", flush=True)
    summary = cost(passes)
    print(f"off {summary['off']}\non  {summary['on']}\ncost {summary['cost']}")
    name = results.output_name("kv_events_cost", args.tag, args.smoke)
    payload = {"settings": vars(args), "passes": passes, **summary}
    print("wrote", results.write_json(name, payload, default=str))


if __name__ == "__main__":
    main()
