"""Several kvfuse servers behind vllm-router (issue 40): which routing policy reuses the most KV.

2-3 `kvfuse serve` processes on this machine (the cores split between them: --threads each),
sharing one Redis tier, each publishing KV events; vllm-router in front with each policy in turn:
round_robin, cache_aware, consistent_hash (on the X-Session-ID header, one session per user) and
kv_aware (on kvfuse's KV events). Two workloads: a multi-user chat (ShareGPT dev conversations,
the users' turns replayed, the history carrying the server's own answers) and RAG (users asking
about shared MuSiQue documents). Per policy and workload: cache-hit share (usage cached_tokens /
prompt_tokens, servers in `server.cached_tokens: exact`), TTFT p50/p95 (streamed, client side),
requests and output tokens per second. Every run starts cold (DELETE /v1/kv on every server:
memory, disk and the shared Redis) with a fresh router; rounds interleave the runs.

Then the kill run: the chat workload under --kill-policy, one server SIGKILLed once half the
requests are answered; failed requests, answers that differ from the run without the kill, and
whether each user's first turn after the kill reused its history (the killed server's users
through the shared Redis tier).

A policy ``kv_aware+affinity`` runs kv_aware with its session affinity (bench/lib/cluster.py
VARIANTS); --no-shared-tier runs the servers without Redis (each its memory and disk), where a
turn sent to another server recomputes its history. --system-chars N starts every chat with
the same N-character system message, computed on every server before a pass (its KV is the only
thing a pass does not start cold with): a deployment's system prompt is hot all day, so users'
first turns are then not cold prefills under any policy; --stagger S spreads the users'
arrivals S seconds apart (by default they all start at once). Each pass keeps its requests
(``rows``: key, prompt and cached tokens, TTFT) and "p95 later", the TTFT p95 of the turns after
each user's first; --router-log-level debug logs kv_aware's per-request prefix credit in
router-POLICY.log.

Results: docs/bench/cluster.json and .png (cluster-quick with --smoke). Targets printed as
pass/fail from the measurements. Needs redis-server and vllm-router (bash bench/setup_router.sh).

    python bench/cluster.py --smoke       # 2 servers, 2 users x 2 turns, max_tokens 4, 2 policies
    python bench/cluster.py               # the full run (long: not on a shared 2-core machine)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib import results  # noqa: E402
from bench.lib.cli import csv, parser  # noqa: E402
from bench.lib.cluster import (  # noqa: E402
    User,
    bounds,
    chat_system,
    chat_users,
    check_targets,
    differing,
    kill_summary,
    median_of,
    rag_users,
    request_rows,
    round_ratios,
    router_command,
    summarize_pass,
)
from bench.lib.paths import default_home  # noqa: E402
from kvfuse_testkit import LocalRedis, ServerProcess, ensure_model, free_port  # noqa: E402

ROUTER = os.environ.get("KVFUSE_VLLM_ROUTER", str(REPO / ".baselines/router-venv/bin/vllm-router"))
POLICIES = "round_robin,cache_aware,consistent_hash,kv_aware"
BLOCK = 16  # server.kv_events_block_size = the router's --kv-event-block-size


def args_parser():
    p = parser(__doc__, "model", "home", "split", ("rounds", {"default": 3}), "tag")
    p.add_argument("--servers", type=int, default=3, help="kvfuse servers (default 3)")
    p.add_argument("--policies", default=POLICIES, help=f"router policies (default {POLICIES})")
    p.add_argument("--workloads", default="chat,rag", help="chat, rag (default both)")
    p.add_argument("--users", type=int, default=12, help="concurrent users (default 12)")
    p.add_argument("--turns", type=int, default=4, help="turns per user (default 4)")
    p.add_argument("--turn-chars", type=int, default=600, help="a chat message's characters")
    p.add_argument("--system-chars", type=int, default=0,
                   help="chat: every conversation starts with the same system message of this "
                   "many characters, already in every server's cache when a pass starts (a "
                   "deployment's system prompt is hot all day); 0: none")  # fmt: skip
    p.add_argument("--stagger", type=float, default=0.0,
                   help="seconds between users' arrivals (user i starts i x S seconds into the "
                   "pass; 0: all at once, a burst of first turns)")  # fmt: skip
    p.add_argument("--doc-sets", type=int, default=3, help="RAG: shared document sets")
    p.add_argument("--docs", type=int, default=3, help="RAG: passages per set")
    p.add_argument("--doc-chars", type=int, default=1500, help="RAG: a passage's characters")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kill-policy", default="consistent_hash", help="policy of the kill run")
    p.add_argument("--no-kill", action="store_true", help="skip the kill run")
    p.add_argument("--no-shared-tier", action="store_true",
                   help="servers without the shared Redis tier (memory and disk each): a turn "
                   "sent to another server recomputes its history (no kill run)")  # fmt: skip
    p.add_argument("--router-args", default="",
                   help="more vllm-router flags for every run, e.g. "
                   "'--kv-aware-session-affinity-ttl-secs 300'")  # fmt: skip
    p.add_argument("--router-log-level", default="info",
                   help="vllm-router's --log-level (debug: kv_aware's per-request prefix scores, "
                   "in the logs folder's router-POLICY.log)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="2 servers, 2 users x 2 turns, 2 policies")
    p.add_argument("--replot", metavar="JSON",
                   help="measure nothing: the table, targets and plot of an earlier run's JSON "
                   "(rewritten with this version's fields)")  # fmt: skip
    return p


def apply_smoke(args) -> None:
    """--smoke: the plumbing end to end, in a few minutes on 2 cores."""
    if args.smoke:
        args.servers, args.users, args.turns, args.max_tokens = 2, 2, 2, 4
        args.policies, args.rounds, args.turn_chars = "round_robin,kv_aware", 1, 300
        args.doc_sets, args.docs, args.doc_chars = 2, 2, 400


class Cluster:
    """The servers (sharing ``redis``) and, per run, a router; every process ended by its PID."""

    def __init__(self, args, redis: LocalRedis, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        threads = max(1, (os.cpu_count() or 1) // args.servers)
        self.servers = []
        for i in range(args.servers):
            events = free_port()
            config = {
                "model": args.model,
                "cache": {"disk_path": str(workdir / f"disk-{i}")}
                | ({} if args.no_shared_tier else {"redis_url": redis.url}),
                "server": {"kv_events_block_size": BLOCK, "cached_tokens": "exact"},
            }
            srv = ServerProcess(
                args.home,
                config=config,
                args=["--threads", str(threads), "--kv-events", f"tcp://127.0.0.1:{events}"],
                env={"OMP_NUM_THREADS": str(threads)},
                log_path=workdir / f"server-{i}.log",
            )
            srv.events_url = f"tcp://127.0.0.1:{events}"
            self.servers.append(srv)
        self.router: subprocess.Popen | None = None
        self.router_port = 0

    def live(self) -> list[ServerProcess]:
        return [s for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def start_router(self, policy: str) -> str:
        """A fresh vllm-router with ``policy`` in front of the live servers; its base URL."""
        self.router_port = free_port()
        live = self.live()
        cmd = router_command(ROUTER, self.router_port, policy, [s.url for s in live],
                             [s.events_url for s in live], BLOCK, self.args.model)  # fmt: skip
        cmd += ["--log-level", self.args.router_log_level, *self.args.router_args.split()]
        log = open(self.workdir / f"router-{policy}.log", "ab")
        self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.router_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited; see {self.workdir}/router-{policy}.log")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url + "/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"vllm-router did not start; see {self.workdir}/router-{policy}.log")

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        self.router = None

    def clear(self) -> None:
        """Every live server's KV dropped (memory, disk, and the shared Redis): a cold start,
        once the background writes of the run before are done (else they land after it)."""
        for s in self.live():
            flushed(s.url)
        for s in self.live():
            httpx.delete(s.url + "/v1/kv", timeout=60).raise_for_status()


def flushed(url: str, timeout: float = 60.0) -> None:
    """Wait until the server's lower-tier writes are done (stats: no queue, no pending save)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/v1/kv/stats", timeout=10).json()
        store = stats["tiers"].get("store", {})
        if not store.get("queue_depth", 0) and not stats["engine"].get("saver", {}).get("pending"):
            return
        time.sleep(0.2)


def ask(base_url: str, user: User, messages: list[dict], max_tokens: int, model: str,
        stream: bool = True) -> dict:  # fmt: skip
    """One chat completion through the router, greedy, with the user's session header; streamed:
    TTFT at the first content chunk, usage from the last chunk (not streamed, as the kill run
    sends them: no TTFT). Never raises: a failure is a sample with ``ok`` False and the error."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    out = {"ok": False, "ttft_s": None, "prompt_tokens": 0, "cached_tokens": 0,
           "completion_tokens": 0, "text": "", "t_sent": t0, "t_done": None,
           "error": None}  # fmt: skip
    try:
        with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=600,
                          headers={"X-Session-ID": user.uid}) as r:  # fmt: skip
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            if stream:
                read_stream(r, out, t0)
            else:
                r.read()
                answer = r.json()
                out["text"] = answer["choices"][0]["message"]["content"] or ""
                take_usage(answer["usage"], out)
        out["ok"] = bool(out["prompt_tokens"])
        if not out["ok"]:
            out["error"] = "no usage"
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["t_done"] = time.monotonic()
    return out


def read_stream(r, out: dict, t0: float) -> None:
    """The text, TTFT and usage of a streamed answer into ``out``."""
    parts: list[str] = []
    for chunk in sse_chunks(r.iter_lines()):
        delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if delta:
            out["ttft_s"] = out["ttft_s"] or time.monotonic() - t0
            parts.append(delta)
        if chunk.get("usage"):
            take_usage(chunk["usage"], out)
    out["text"] = "".join(parts)


def take_usage(u: dict, out: dict) -> None:
    out["prompt_tokens"] = u["prompt_tokens"]
    out["completion_tokens"] = u["completion_tokens"]
    out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def sse_chunks(lines):
    """The JSON objects of an SSE stream's ``data:`` lines, up to ``[DONE]``."""
    import json

    for line in lines:
        if line.startswith("data: "):
            if line[6:].strip() == "[DONE]":
                return
            yield json.loads(line[6:])


def run_users(base_url: str, users: list[User], args, on_sample=None, stream=True) -> tuple:
    """Every user in a thread of its own, its turns one after the other, user i starting
    ``i * args.stagger`` seconds after the first; (samples, wall s)."""
    samples: list[dict] = []
    lock = threading.Lock()

    def one(user: User, delay: float) -> None:
        time.sleep(delay)
        history = [{"role": "system", "content": user.system}] if user.system else []
        for t, text in enumerate(user.turns):
            msgs = history + [{"role": "user", "content": text}]
            s = ask(base_url, user, msgs, args.max_tokens, args.model, stream)
            s.update(user=user.uid, turn=t, key=f"{user.uid}/{t}")
            with lock:
                samples.append(s)
            if on_sample is not None:
                on_sample(s)
            if user.history:
                history = msgs + [{"role": "assistant", "content": s["text"] or "(no answer)"}]

    t0 = time.monotonic()
    threads = [
        threading.Thread(target=one, args=(u, i * args.stagger)) for i, u in enumerate(users)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return samples, time.monotonic() - t0


def warm_systems(cluster: Cluster, users: list[User], args) -> None:
    """Each live server computes and keeps the users' shared system messages (one request each,
    straight to the server, not measured), its writes done, before the router starts: the state
    of a deployment whose system prompt every server has served before."""
    for system in sorted({u.system for u in users if u.system}):
        for s in cluster.live():
            body = {"model": args.model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": "Hello."}]}  # fmt: skip
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
    for s in cluster.live():
        flushed(s.url)


def one_run(cluster: Cluster, policy: str, users: list[User], args) -> tuple:
    """A cold run of one workload under one policy (but for the users' shared system messages,
    warm on every server); (summary, outputs by request key)."""
    cluster.clear()
    warm_systems(cluster, users, args)
    url = cluster.start_router(policy)
    try:
        samples, wall = run_users(url, users, args)
    finally:
        cluster.stop_router()
    errors = [s["error"] for s in samples if not s["ok"]]
    summary = {**summarize_pass(samples, wall), "wall_s": round(wall, 2), "errors": errors[:5]}
    summary["rows"] = request_rows(samples)
    return summary, {s["key"]: s["text"] for s in samples if s["ok"]}


def kill_run(cluster: Cluster, args, users: list[User], chats: list[dict[str, str]]) -> dict:
    """The chat workload under the kill policy; server 0 SIGKILLed once half the requests are
    answered (the router's circuit breaker and health check drop it; its users move to the
    others). Not streamed: vllm-router retries a request whose worker dies before it answered,
    but cannot retry a stream it has begun relaying (docs/deploy.md, "When a server dies")."""
    cluster.clear()
    warm_systems(cluster, users, args)
    url = cluster.start_router(args.kill_policy)
    total = sum(len(u.turns) for u in users)
    done, killed = [0], {"at": float("inf")}
    lock = threading.Lock()

    def on_sample(_s: dict) -> None:
        with lock:
            done[0] += 1
            if done[0] * 2 >= total and killed["at"] == float("inf"):
                killed["at"] = time.monotonic()
                cluster.servers[0].kill()

    try:
        samples, wall = run_users(url, users, args, on_sample, stream=False)
    finally:
        cluster.stop_router()
    summary = kill_summary(samples, killed["at"], *reference_of(chats))
    summary["policy"], summary["killed"] = args.kill_policy, cluster.servers[0].url
    summary["pass"] = summarize_pass(samples, wall)
    summary["errors"] = [s["error"] for s in samples if not s["ok"]][:5]
    return summary


def workloads(args) -> dict[str, list[User]]:
    out = {}
    for name in csv(args.workloads):
        if name == "chat":
            system = chat_system(args.system_chars, args.split) if args.system_chars else ""
            out[name] = chat_users(args.users, args.turns, args.turn_chars, args.split, system)
        elif name == "rag":
            out[name] = rag_users(
                args.users, args.turns, args.doc_sets, args.docs, args.doc_chars, args.split
            )
        else:
            raise SystemExit(f"unknown workload {name!r} (chat, rag)")
    return out


def measure(cluster: Cluster, args, loads: dict[str, list[User]]) -> tuple:
    """Every (workload, policy) run once per round, the order rotated each round; the passes by
    workload and policy, and the chat outputs of every pass of the kill policy (else of the first
    chat pass): the kill run's reference."""
    policies = csv(args.policies)
    runs = [(w, p) for w in loads for p in policies]
    passes: dict = {w: {p: [] for p in policies} for w in loads}
    chats: list[dict[str, str]] = []
    for r in range(args.rounds):
        k = r % len(runs)
        for w, p in runs[k:] + runs[:k]:
            summary, outputs = one_run(cluster, p, loads[w], args)
            passes[w][p].append(summary)
            if w == "chat" and (p == args.kill_policy or args.kill_policy not in policies):
                chats.append(outputs)
            print(f"round {r} {w:5s} {p:16s} {summary}", flush=True)
    return passes, chats


def reference_of(chats: list[dict[str, str]]) -> tuple[dict[str, str], int | None]:
    """The kill run's reference (the first chat outputs kept) and its floor: how many answers
    differ between the first two of them, two runs without a kill (None with one run)."""
    if not chats:
        return {}, None
    floor = len(differing(chats[1], chats[0])[0]) if len(chats) > 1 else None
    return chats[0], floor


def report(passes: dict, kill: dict | None) -> tuple[dict, list[dict]]:
    """The medians by workload and policy, printed as a table, and the targets, printed."""
    medians = {w: {p: median_of(ps) for p, ps in by.items() if ps} for w, by in passes.items()}
    rows = [[w, p, m["hit_share"], m["ttft_p50_ms"], m["ttft_p95_ms"], m.get("ttft_p95_later_ms"),
             m["req_s"], m["out_tok_s"], m["failed"]]
            for w, by in medians.items() for p, m in by.items()]  # fmt: skip
    results.print_table(
        ["workload", "policy", "hit share", "TTFT p50 ms", "p95 ms", "p95 later", "req/s", "tok/s",
         "failed"],
        rows,
    )  # fmt: skip
    if kill is not None:
        print(f"kill run ({kill['policy']}, {kill['killed']} killed): failed {kill['failed']}, "
              f"differing answers after the kill {kill['wrong_answers']}/{kill['compared']} "
              f"(before it {kill['differing_before_kill']}; between two runs without a kill "
              f"{kill['differing_without_kill']}; not comparable {kill['not_comparable']}), "
              f"users reusing history after the kill "
              f"{kill['users_reusing_after_kill']}/{kill['users_after_kill']}")  # fmt: skip
    for w, by in passes.items():
        for p, ratios in round_ratios(by, "ttft_p95_ms").items():
            print(f"{w}: TTFT p95 round_robin / {p}, round by round: {ratios}")
    targets = check_targets(medians, kill)
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        print(f"[{verdict}] {t['target']}: {t['measured']}")
    return medians, targets


def plot(medians: dict, passes: dict, target: str) -> None:
    """Medians as bars, the rounds' min and max as whiskers."""
    plt = results.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = ((axes[0], "hit_share", "cache-hit share"), (axes[1], "ttft_p95_ms", "TTFT p95 (ms)"),
              (axes[2], "ttft_p95_later_ms", "TTFT p95, turns after the first (ms)"))  # fmt: skip
    for ax, key, label in panels:
        for i, (w, by) in enumerate(medians.items()):
            names = list(by)
            xs = [j + 0.4 * i for j in range(len(names))]
            ys = [by[p].get(key) or 0 for p in names]
            spans = [bounds(passes[w][p], key) or (y, y) for p, y in zip(names, ys)]
            err = [
                [y - lo for y, (lo, _) in zip(ys, spans)],
                [hi - y for y, (_, hi) in zip(ys, spans)],
            ]
            ax.bar(xs, ys, width=0.4, label=w, yerr=err, capsize=4)
            ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20)
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    print("wrote", results.save_figure(fig, target))


def replot(path: str) -> None:
    """--replot: an earlier run's results reported, written and drawn again."""
    import json

    payload = json.loads(Path(path).read_text())
    medians, targets = report(payload["passes"], payload.get("kill"))
    payload |= {"medians": medians, "targets": targets, "p95_ratios_by_round": {
        w: round_ratios(by, "ttft_p95_ms") for w, by in payload["passes"].items()}}  # fmt: skip
    target = results.stem(Path(path))
    print("wrote", results.write_json(target, payload))
    plot(medians, payload["passes"], target)


def main() -> None:
    args = args_parser().parse_args()
    if args.replot:
        return replot(args.replot)
    apply_smoke(args)
    args.home = args.home or str(default_home())
    if not Path(ROUTER).is_file():
        raise SystemExit(f"no vllm-router at {ROUTER}: bash bench/setup_router.sh")
    ensure_model(args.home, args.model)
    loads = workloads(args)
    print(f"split {args.split}; {args.servers} servers; policies {args.policies}", flush=True)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvfuse-bench-cluster-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {workdir}", flush=True)
    with LocalRedis() as redis:
        cluster = Cluster(args, redis, workdir)
        try:
            for s in cluster.servers:
                s.start(timeout=900)
            passes, chats = measure(cluster, args, loads)
            kill = None
            if not args.no_kill and not args.no_shared_tier and "chat" in loads:
                kill = kill_run(cluster, args, loads["chat"], chats)
        finally:
            cluster.stop_router()
            for s in cluster.servers:
                s.close()
    medians, targets = report(passes, kill)
    name = results.output_name("cluster", args.tag, args.smoke)
    ratios = {w: round_ratios(by, "ttft_p95_ms") for w, by in passes.items()}
    payload = {"split": args.split, "settings": {k: v for k, v in vars(args).items()},
               "medians": medians, "passes": passes, "kill": kill, "targets": targets,
               "p95_ratios_by_round": ratios}  # fmt: skip
    print("wrote", results.write_json(name, payload))
    plot(medians, passes, name)


if __name__ == "__main__":
    main()
