"""Multi-round chat at scale: N users, R rounds each, a shared system prompt, think time between
rounds, histories that outgrow the KV memory. kvfuse (memory + disk tiers, history reuse,
prefetch) vs vLLM CPU (its prefix cache in its KV space) vs kvfuse with the cache off (and, with
``--servers ...,llama.cpp``, vs llama.cpp's ``llama-server`` with its prompt cache): TTFT
p50/p95, throughput, and the largest users x rounds whose p95 TTFT stays under a stated bound
(the score of LMCache's multi-round QA benchmark).

**Workload** (the same for every server; ``build_workload`` is pure and seeded):

- a shared system prompt of ``--system-words`` words (~1,000 tokens with SmolLM2's tokenizer):
  an instruction, then MuSiQue **dev** documents (examples 0-49 of ``../shared/data/musique_s.json``);
- ``users`` chat users, each a real conversation of ``../shared/data/sharegpt_multiturn_dev.jsonl``
  (the dev file; the seed orders the conversations and every load takes the first ``users``, so a
  larger load contains the smaller ones). A user is *returning* to that conversation: its first
  recorded exchanges (user and assistant messages, ``--prior-chars`` characters, ~800 tokens) are
  its earlier chat, and the next ``--rounds`` user messages (each cut to ``--question-chars``)
  are the questions it asks now. Each round sends the whole chat so far (system prompt, earlier
  chat, every earlier question and the server's own earlier answers) plus the next question, as
  a chat client does: a plain streamed ``/v1/chat/completions`` request with the full history,
  carrying OpenAI's ``prompt_cache_key`` (one per user and run: kvfuse lines the turn up with that
  user's stored history by it, and finds it by content without it; vLLM ignores it) and a
  ``cache_salt`` per run (both servers honour it, so every run starts cold). Nothing else: no
  kvfuse-only field is needed for the history to be saved, moved to disk and prefetched;
- answers of exactly ``--answer-tokens`` tokens (greedy, ``ignore_eos``: both servers accept it),
  so every server's histories grow alike;
- user ``i`` starts ``i * --stagger`` s into the run; after each answer a user thinks for an
  exponential time (mean ``--think``, capped at 3x the mean; seeded per user);
- before the timed rounds (untimed, cache-on series only), each user's earlier chat is sent
  once with a one-token answer, user 0 first, then 4 at a time in user order: what a server
  would hold from the users' earlier sessions. Whatever of it the server's KV RAM cannot keep,
  it must find elsewhere (kvfuse: its disk tier) or recompute (vLLM). Cache off: nothing to warm.

**KV memory.** Both servers get the same RAM for KV (``--kv-mib``, default 768 MiB): vLLM as its
whole KV space (``--kv-cache-memory-bytes``; paged, fp32 KV = the model's dtype, vLLM's default;
shared prefixes stored once; its prefix cache is the blocks running sequences do not hold),
kvfuse as its live KV budget (``engine.kv_memory_bytes``: fp16 KV, its default; one cache per
running sequence) plus a small memory tier (``--kvfuse-tier-mib`` of the total,
``cache.memory_bytes``), with the disk tier on (a temp folder), ``cache.eviction: queue`` and
``cache.prefetch: true`` (the defaults). The table's ``history`` column is every user's chat at
the end of a run, the system prompt counted once, and its size against each server's KV RAM in
tokens: above 1x, the histories do not fit.

**Method.** Servers run one at a time (never two at once). Loads (``--users`` at ``--rounds``
rounds each) are swept upwards; kvfuse's cache-on and cache-off runs alternate at each load (the
order alternates too) in one server process (``"cache": false`` per request for off: no lookup,
load or store), then vLLM runs the same loads, then llama.cpp. A series stops after its first load whose p95
TTFT exceeds the bound (the loads above it are not run). A series' first (smallest) load runs
in full; at the others, once more of a run's requests are over the bound than its p95 allows
(the run cannot pass any more), the users send no further rounds: the run is marked ``cut`` and
its p50/p95 are over the requests done (its p95 a lower bound). This keeps failing runs, the
slowest ones, short on a shared machine; ``--no-stop-early`` runs them in full. A run sends no
new round after ``--max-point-s`` either (a guard; such a run fails). TTFT is client-side:
request sent -> first streamed content token.

**Score** (``score``): the largest users x rounds such that this load and every smaller load
measured kept p95 TTFT <= ``--bound`` with every planned request served. The issue's target:
kvfuse's score > vLLM's, and at vLLM's largest passing load kvfuse's p95 TTFT >= 3x lower.

**Reading the result.** The table: per series and load, requests done / planned, TTFT p50/p95
(and p95 of round 1 and of later rounds), output tokens/s (completion tokens / the run's wall
time, think time included), the share of prompt tokens the server reports as cached
(``usage.prompt_tokens_details.cached_tokens``), the history size, pass/fail. Then the scores
and the p95 TTFT of each series at vLLM's largest passing load. ``where kvfuse's time goes``
reads kvfuse's ``/metrics`` around each run: queue wait and the engine's TTFT (queue + lookup +
load + prefill) per request, decode time per token, prompt tokens prefilled per request,
sequences per forward pass, chunks reused by tier, prefetch hits/misses, preemptions, memory-tier
evictions. ``same answers``: answers identical to kvfuse cache off's at the same load (greedy;
a near-tie, two candidate tokens within float rounding, can flip a token, and then the rest of
that user's chat differs too; kvfuse keeps fp16 KV and vLLM fp32, so kvfuse vs vLLM differs
more). Each run records the machine's load average at its start and end: the benchmark machine
is shared, and a load above 2 (its cores) slows every server.

**llama.cpp** (``--servers kvfuse,vllm,llama.cpp``; ``bash bench/setup_llama_server.sh`` builds the
binary): ``llama-server`` on the model's GGUF as F32 (``--llama-gguf``: kvfuse's fp32 weights), a
fresh server for each load (it honours no ``cache_salt``: a new server is a cold cache), warmed up
like the others, its users' earlier chats sent once as for the other cache-on series, then the
timed rounds. Started as (bench/lib/llama_server.py)

    llama-server --model <smollm2 F32 gguf> --alias smollm2 --host 127.0.0.1 --port P
        --threads N --threads-batch N --ctx-size C --parallel U --kv-unified
        --cache-prompt --cache-reuse 256 --metrics --no-webui

N = ``--llama-threads`` (default: all cores, the threads kvfuse and vLLM use), U = the load's users
(a slot per user), C = ``--kv-mib`` of f16 KV in tokens (the same KV RAM as the others), shared by
every slot; its prompt cache (each slot's last prompt, ``--cache-reuse`` chunks, its host-RAM
prompt cache of ``--cache-ram`` 8192 MiB by default) as llama.cpp ships it.

Results: ``docs/bench/multiround.json`` and ``docs/bench/multiround.png`` (``--quick``:
``multiround-quick.*``, a smoke run of 1-2 minutes per server; ``--tag T``: ``multiround-T.*``).

    KVFUSE_HOME=... .venv/bin/python bench/multiround.py   # ~20 min on an idle machine, vLLM start-up included
    KVFUSE_HOME=... .venv/bin/python bench/multiround.py --quick --servers kvfuse
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.lib import servers as srvs
from bench.lib.cli import parser
from bench.lib.client import Runner, kvfuse_accepts_ignore_eos, percentile, request_extra, warm_up
from bench.lib.data import musique
from bench.lib.metrics import delta, first_total, metric_total, scrape_metrics
from bench.lib.paths import DATA
from bench.lib.results import (
    output_name,
    plot_path,
    print_table,
    pyplot,
    save_figure,
    stem,
    write_json,
)
from bench.lib.rounds import order
from bench.lib.servers import kv_bytes_per_token

SERIES = ("kvfuse-on", "kvfuse-off", "vllm", "llama.cpp")
LABELS = {
    "kvfuse-on": "kvfuse (memory + disk, prefetch)",
    "kvfuse-off": "kvfuse cache off",
    "vllm": "vLLM CPU (prefix caching)",
    "llama.cpp": "llama.cpp server (prompt cache)",
}

INSTRUCTION = (
    "You are a helpful assistant for a research team. The reference documents below are shared by "
    "every conversation; use them when they are relevant, otherwise answer from general knowledge. "
    "Answer clearly and completely.\n\nReference documents:\n"
)


# ----------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class User:
    name: str  # u<index>
    conversation: str  # the ShareGPT id the earlier chat and the questions come from
    prior: tuple[tuple[str, str], ...]  # the earlier chat: recorded (question, answer) exchanges
    questions: tuple[str, ...]  # one per round
    think_s: tuple[float, ...]  # after each answer but the last
    start_s: float


@dataclass(frozen=True)
class Workload:
    system: str
    users: tuple[User, ...]
    rounds: int
    answer_tokens: int

    @property
    def load(self) -> int:
        return len(self.users) * self.rounds


def system_prompt(words: int, examples: list[dict] | None = None) -> str:
    """The shared system prompt: the instruction, then MuSiQue dev documents in order, ``words`` words of them."""
    examples = musique("dev") if examples is None else examples
    out: list[str] = []
    for ex in examples:
        for ctx in ex["ctxs"]:
            out += ctx["text"].split()
            if len(out) >= words:
                return INSTRUCTION + " ".join(out[:words])
    raise ValueError(f"the dev documents hold fewer than {words} words")


def load_conversations(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """(id, [(user, assistant), ...]) of every conversation in the (dev) ShareGPT file, in file order."""
    out = []
    with open(path) as f:
        for line in f:
            conv = json.loads(line)
            msgs = conv["messages"]
            pairs = [
                (msgs[i]["content"], msgs[i + 1]["content"])
                for i in range(0, len(msgs) - 1, 2)
                if msgs[i]["role"] == "user" and msgs[i + 1]["role"] == "assistant"
            ]
            out.append((str(conv["id"]), pairs))
    return out


def split_conversation(
    pairs: list[tuple[str, str]],
    rounds: int,
    prior_chars: int,
    message_chars: int,
    question_chars: int,
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]] | None:
    """A conversation as (earlier chat, questions): recorded exchanges (each message cut to
    ``message_chars``) from the start while they hold fewer than ``prior_chars`` characters (at
    least one when ``prior_chars`` > 0), then the next ``rounds`` questions; None if too short."""
    prior: list[tuple[str, str]] = []
    chars = 0
    while prior_chars > 0 and len(prior) < len(pairs) and (not prior or chars < prior_chars):
        q, a = pairs[len(prior)]
        q, a = q[:message_chars].strip(), a[:message_chars].strip()
        prior.append((q, a))
        chars += len(q) + len(a)
    rest = pairs[len(prior) :]
    if len(rest) < rounds:
        return None
    questions = tuple(q[:question_chars].strip() or "Please continue." for q, _ in rest[:rounds])
    return tuple(prior), questions


def build_workload(
    conversations: list[tuple[str, list[tuple[str, str]]]],
    system: str,
    users: int,
    rounds: int,
    answer_tokens: int,
    think_mean_s: float,
    stagger_s: float,
    question_chars: int,
    prior_chars: int,
    seed: int,
    message_chars: int = 2000,
) -> Workload:
    """``users`` users of ``rounds`` rounds: pure and deterministic for a seed. The seed orders the
    conversations (user ``i`` is the same at every load), and draws each user's think times."""
    eligible = []
    for cid, pairs in conversations:
        split = split_conversation(pairs, rounds, prior_chars, message_chars, question_chars)
        if split is not None:
            eligible.append((cid, *split))
    if len(eligible) < users:
        raise ValueError(
            f"{len(eligible)} conversations have an earlier chat and {rounds} more questions, "
            f"{users} users wanted"
        )
    order = list(range(len(eligible)))
    random.Random(seed).shuffle(order)
    out = []
    for i in range(users):
        cid, prior, qs = eligible[order[i]]
        rng = random.Random(f"{seed}/{i}")
        think = tuple(
            round(min(rng.expovariate(1.0 / think_mean_s), 3 * think_mean_s), 3)
            if think_mean_s > 0
            else 0.0
            for _ in range(rounds - 1)
        )
        out.append(User(f"u{i}", cid, prior, qs, think, round(i * stagger_s, 3)))
    return Workload(system, tuple(out), rounds, answer_tokens)


def opening(wl: Workload, u: User) -> list[dict]:
    """A user's chat before its first round: the system prompt and its earlier exchanges."""
    msgs = [{"role": "system", "content": wl.system}]
    for q, a in u.prior:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def token_counts(model_dir: Path, workloads: dict[int, Workload]) -> dict:
    """Tokens of the shared system prompt and of each user's opening chat (the model's tokenizer and template)."""
    from kvfuse.models.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    wl = workloads[max(workloads)]
    openings = [len(tok.encode_chat(opening(wl, u))) for u in wl.users]
    return {
        "system_tokens": len(
            tok.encode_chat([{"role": "system", "content": wl.system}], add_generation_prompt=False)
        ),
        "opening_tokens": {
            "min": min(openings),
            "median": statistics.median(openings),
            "max": max(openings),
        },
        "question_tokens_mean": round(
            statistics.fmean(
                len(tok.encode(q, add_special_tokens=False)) for u in wl.users for q in u.questions
            ),
            1,
        ),
    }


# -------------------------------------------------------------------------------------- score


def p95_cannot_pass(over_bound: int, planned: int) -> bool:
    """Whether ``over_bound`` requests over the bound already fail the p95 of ``planned`` requests
    (``percentile``'s nearest rank: the p95 is the value at index round(0.95 (n - 1)) of the sorted list)."""
    if planned <= 0:
        return False
    allowed = planned - 1 - round(0.95 * (planned - 1))  # values above the p95's rank
    return over_bound > allowed


def passes(point: dict, bound_s: float) -> bool:
    """A load passes when every planned request was served and its p95 TTFT is within the bound."""
    return (
        point["errors"] == 0
        and point["requests"] == point["planned"]
        and point["ttft_p95_s"] is not None
        and point["ttft_p95_s"] <= bound_s
    )


def score(points: list[dict], bound_s: float) -> dict:
    """The largest load (users x rounds) such that it and every smaller measured load pass.

    ``points``: one series' runs (``load``, ``users``, ``rounds``, ``ttft_p95_s``, ``requests``,
    ``planned``, ``errors``); a load measured more than once passes when its median p95 does.
    Returns ``{"load", "users", "rounds"}`` (all None if the smallest load fails) and ``first_fail``."""
    by_load: dict[int, list[dict]] = {}
    for p in points:
        by_load.setdefault(p["load"], []).append(p)
    best: dict | None = None
    first_fail = None
    for load in sorted(by_load):
        runs = by_load[load]
        ok = (
            sum(passes(p, bound_s) for p in runs) * 2 > len(runs)
            if len(runs) > 1
            else passes(runs[0], bound_s)
        )
        if not ok:
            first_fail = load
            break
        best = runs[0]
    return {
        "load": best["load"] if best else None,
        "users": best["users"] if best else None,
        "rounds": best["rounds"] if best else None,
        "first_fail": first_fail,
    }


def p95_at(points: list[dict], load: int | None) -> float | None:
    """The median p95 TTFT of a series' runs at ``load`` (None: not measured there)."""
    xs = [p["ttft_p95_s"] for p in points if p["load"] == load and p["ttft_p95_s"] is not None]
    return statistics.median(xs) if xs else None


def comparison(series: dict[str, list[dict]], bound_s: float) -> dict:
    """Scores per series, p95 TTFT of each at vLLM's largest passing load, and the target's verdict."""
    scores = {name: score(pts, bound_s) for name, pts in series.items()}
    out: dict = {"bound_s": bound_s, "scores": scores}
    v = scores.get("vllm")
    if v is None:
        return out
    ref = v["load"]
    if ref is None:  # vLLM passed no load: compare at its smallest one
        loads = sorted(p["load"] for p in series["vllm"])
        ref = loads[0] if loads else None
    out["reference_load"] = ref
    out["reference"] = (
        "vLLM's largest passing load"
        if v["load"] is not None
        else "vLLM passed no load: its smallest"
    )
    out["p95_at_reference_s"] = {name: p95_at(pts, ref) for name, pts in series.items()}
    on = series.get("kvfuse-on")
    if on is not None:
        k, vv = out["p95_at_reference_s"].get("kvfuse-on"), out["p95_at_reference_s"].get("vllm")
        ratio = round(vv / k, 2) if k and vv else None
        out["vllm_over_kvfuse_p95"] = ratio
        more = scores["kvfuse-on"]["load"] is not None and (
            v["load"] is None or scores["kvfuse-on"]["load"] > v["load"]
        )
        out["target"] = {
            "kvfuse_serves_more": more,
            "p95_3x_lower": ratio is not None and ratio >= 3,
            "met": bool(more and ratio is not None and ratio >= 3),
        }
    return out


# ---------------------------------------------------------------------------------------- runs


@dataclass
class Point:
    series: str
    users: int
    rounds: int
    load: int
    planned: int
    requests: int = 0
    errors: int = 0
    cut: bool = False  # stopped early: the p95 could no longer pass
    over_bound: int = 0
    wall_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_max_s: float | None = None
    ttft_p95_round1_s: float | None = None
    ttft_p95_later_s: float | None = None  # rounds >= 2: the history re-sent
    latency_p50_s: float | None = None
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    history_tokens_end: int = (
        0  # what every user's chat holds at the end: last prompt + its answer, summed
    )
    mean_active: float = 0.0  # requests in flight, averaged over the run
    warm_s: float | None = None  # the untimed warm-up of the users' earlier chats (cache on)
    loadavg: list[float] = field(
        default_factory=list
    )  # the machine's 1-minute load average at start and end
    ran_at: str = ""
    metrics: dict = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


class Driver:
    """Runs one workload (all its users at once, each a thread) against one server."""

    def __init__(self, base_url: str, model: str, ignore_eos: bool):
        self.runner = Runner(base_url, model, "multiround", ignore_eos)
        self.ignore_eos = ignore_eos
        self.url = base_url.removesuffix("/v1")  # the server's, for /metrics

    def extra(self, cache: bool, salt: str, user: str | None = None) -> dict:
        return request_extra(cache, salt, self.ignore_eos, user)

    def warm(self, wl: Workload, salt: str, clients: int = 4) -> float:
        """Untimed: each user's earlier chat (system prompt and earlier exchanges) sent once, one
        token answered, so that the server has it as a user returning to a conversation finds it.
        User 0 first (the shared system prompt), then the others ``clients`` at a time, in user
        order. The seconds it took."""
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()

        def one(u: User) -> None:
            self.runner.stream(self.extra(True, salt, u.name), 1, messages=opening(wl, u))

        one(wl.users[0])
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, wl.users[1:]))
        return time.perf_counter() - t0

    def run(
        self,
        wl: Workload,
        series: str,
        cache: bool,
        salt: str,
        bound_s: float,
        stop_early: bool,
        max_wall_s: float,
    ) -> tuple[Point, dict[str, str]]:
        run = _Run(self, wl, Point(series, len(wl.users), wl.rounds, wl.load, wl.load))
        run.cache, run.salt, run.bound_s = cache, salt, bound_s
        run.stop_early, run.max_wall_s = stop_early, max_wall_s
        return run.go()


class _Run:
    """One run's state: its users' threads, the samples they record, the early stop."""

    def __init__(self, driver: Driver, wl: Workload, point: Point):
        self.driver, self.wl, self.point = driver, wl, point
        self.samples: list[dict] = []
        self.outputs: dict[str, str] = {}
        self.errors: list[str] = []
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.active, self.area, self.last = 0, 0.0, time.perf_counter()  # in flight, its integral
        self.history_end: dict[str, int] = {}
        self.t0 = time.perf_counter()

    def inflight(self, change: int) -> None:
        with self.lock:
            now = time.perf_counter()
            self.area += self.active * (now - self.last)
            self.last = now
            self.active += change

    def user(self, u: User) -> None:
        if self.stop.wait(u.start_s):
            return
        msgs = opening(self.wl, u)
        for r, q in enumerate(u.questions):
            if self.stop.is_set() or time.perf_counter() - self.t0 > self.max_wall_s:
                return
            msgs.append({"role": "user", "content": q})
            s = self.ask(u, r, msgs)
            if s is None:  # counted and reported; this user stops (its history is broken)
                return
            msgs.append({"role": "assistant", "content": s["text"]})
            if r < len(u.think_s) and self.stop.wait(u.think_s[r]):
                return

    def ask(self, u: User, r: int, msgs: list[dict]) -> dict | None:
        sent = time.perf_counter() - self.t0
        self.inflight(+1)
        try:
            extra = self.driver.extra(self.cache, self.salt, u.name)
            s = self.driver.runner.stream(extra, self.wl.answer_tokens, messages=list(msgs))
        except Exception as e:
            with self.lock:
                self.errors.append(f"{u.name}/r{r + 1}: {type(e).__name__}: {e}"[:300])
            return None
        finally:
            self.inflight(-1)
        s.update(user=u.name, round=r + 1, sent_s=sent)
        self.record(u, r, s)
        return s

    def record(self, u: User, r: int, s: dict) -> None:
        p = self.point
        with self.lock:
            self.samples.append(s)
            self.outputs[f"{u.name}/r{r + 1}"] = s["text"]
            if s["prompt_tokens"] is not None:
                self.history_end[u.name] = s["prompt_tokens"] + s["completion_tokens"]
            p.over_bound += s["ttft"] > self.bound_s
            if self.stop_early and p95_cannot_pass(p.over_bound, p.planned):
                self.stop.set()  # no new rounds; the run is "cut" if requests were left unsent

    def go(self) -> tuple[Point, dict[str, str]]:
        self.point.ran_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        load_before = os.getloadavg()[0]
        threads = [
            threading.Thread(target=self.user, args=(u,), daemon=True) for u in self.wl.users
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - self.t0
        self.inflight(0)
        self.summarize(wall)
        self.point.loadavg = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        return self.point, self.outputs

    def summarize(self, wall: float) -> None:
        p, s = self.point, self.samples
        ttft = [x["ttft"] for x in s]
        first = [x["ttft"] for x in s if x["round"] == 1]
        later = [x["ttft"] for x in s if x["round"] > 1]
        cached = [x["cached"] for x in s if x["cached"] is not None]
        out_tokens = sum(x["completion_tokens"] or 0 for x in s)
        p.requests, p.errors, p.error_samples = len(s), len(self.errors), self.errors[:3]
        p.cut = len(s) + len(self.errors) < p.planned
        p.wall_s = round(wall, 2)
        p.ttft_p50_s, p.ttft_p95_s = _r(percentile(ttft, 0.5)), _r(percentile(ttft, 0.95))
        p.ttft_max_s = _r(max(ttft)) if ttft else None
        p.ttft_p95_round1_s = _r(percentile(first, 0.95))
        p.ttft_p95_later_s = _r(percentile(later, 0.95))
        p.latency_p50_s = _r(percentile([x["latency"] for x in s], 0.5))
        p.output_tokens = out_tokens
        p.output_tokens_per_s = round(out_tokens / wall, 2) if wall > 0 else 0.0
        p.prompt_tokens = sum(x["prompt_tokens"] or 0 for x in s)
        p.cached_tokens = sum(cached) if cached else None
        p.history_tokens_end = sum(self.history_end.values())
        p.mean_active = round(self.area / wall, 2) if wall > 0 else 0.0


def same_answers(a: dict[str, str], b: dict[str, str]) -> str | None:
    both = sorted(set(a) & set(b))
    return f"{sum(a[k] == b[k] for k in both)}/{len(both)}" if both else None


# ------------------------------------------------------------------------------------- metrics

KVFUSE_METRICS = {  # field: (metric, labels)
    "queue_wait_s": ("kvfuse_queue_wait_seconds_sum", {}),
    "queue_wait_n": ("kvfuse_queue_wait_seconds_count", {}),
    "engine_ttft_s": ("kvfuse_time_to_first_token_seconds_sum", {}),
    "engine_ttft_n": ("kvfuse_time_to_first_token_seconds_count", {}),
    "tpot_s": ("kvfuse_time_per_output_token_seconds_sum", {}),
    "tpot_n": ("kvfuse_time_per_output_token_seconds_count", {}),
    "prompt_cached": ("kvfuse_prompt_tokens_total", {"source": "cached"}),
    "prompt_prefilled": ("kvfuse_prompt_tokens_total", {"source": "prefilled"}),
    "history_reused_tokens": ("kvfuse_history_reused_tokens_total", {}),
    "preemptions": ("kvfuse_preemptions_total", {}),
    "steps": ("kvfuse_engine_steps_total", {}),
    "step_sequences": ("kvfuse_batch_sequences_sum", {}),
    "step_tokens": ("kvfuse_batch_tokens_sum", {}),
    "prefetch_hits": ("kvfuse_prefetch_hits_total", {}),
    "prefetch_misses": ("kvfuse_prefetch_misses_total", {}),
    "prefetched_chunks": ("kvfuse_prefetched_chunks_total", {}),
    "memory_evictions": ("kvfuse_tier_evictions_total", {"tier": "memory"}),
    "protected_evictions": ("kvfuse_tier_protected_evictions_total", {"tier": "memory"}),
    "save_waits": ("kvfuse_save_waits_total", {}),
    "save_wait_s": ("kvfuse_save_wait_seconds_total", {}),
    "kv_memory_peak_bytes": ("kvfuse_kv_memory_peak_bytes", {}),
}
VLLM_METRICS = {  # field: candidate names (they changed across vLLM versions)
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "queue_s": ("vllm:request_queue_time_seconds_sum",),
    "queue_n": ("vllm:request_queue_time_seconds_count",),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum",),
    "prefill_n": ("vllm:request_prefill_time_seconds_count",),
}
LLAMA_METRICS = {  # llama-server --metrics
    "prompt_tokens": ("llamacpp:prompt_tokens_total",),
    "prompt_tokens_cached": ("llamacpp:prompt_tokens_cached_total",),
    "prompt_s": ("llamacpp:prompt_seconds_total",),
    "tokens_predicted": ("llamacpp:tokens_predicted_total",),
    "tokens_predicted_s": ("llamacpp:tokens_predicted_seconds_total",),
    "decode_calls": ("llamacpp:n_decode_total",),
}


def kvfuse_metrics(url: str) -> dict[str, float]:
    """The kvfuse counters that say where a run's time went (summed over labels where noted)."""
    s = scrape_metrics(url)
    out = {k: metric_total(s, name, **labels) for k, (name, labels) in KVFUSE_METRICS.items()}
    for name, lab, v in s:
        if name == "kvfuse_reused_chunks_total":
            out[f"reused_chunks_{lab.get('tier', '?')}"] = v
    return out


def vllm_metrics(url: str) -> dict[str, float]:
    s = scrape_metrics(url)
    return {k: first_total(s, *names) for k, names in VLLM_METRICS.items()}


def llama_metrics(url: str) -> dict[str, float]:
    s = scrape_metrics(url)
    return {k: first_total(s, *names) for k, names in LLAMA_METRICS.items()}


def time_split(m: dict[str, float], requests: int) -> dict[str, float | None]:
    """Per-request means from a kvfuse run's metric deltas: queue wait, engine TTFT, tokens."""

    def per(a: str, n: str) -> float | None:
        return round(m[a] / m[n], 3) if m.get(n) else None

    prompt = m.get("prompt_cached", 0) + m.get("prompt_prefilled", 0)
    return {
        "queue_wait_s": per("queue_wait_s", "queue_wait_n"),
        "engine_ttft_s": per("engine_ttft_s", "engine_ttft_n"),
        "decode_s_per_token": per("tpot_s", "tpot_n"),
        "prefilled_tokens_per_request": round(m.get("prompt_prefilled", 0) / requests, 1)
        if requests
        else None,
        "reused_share": round(m.get("prompt_cached", 0) / prompt, 3) if prompt else None,
        "sequences_per_step": round(m["step_sequences"] / m["steps"], 2)
        if m.get("steps")
        else None,
    }


# -------------------------------------------------------------------------------------- servers


def run_kvfuse(b: Bench) -> None:
    """kvfuse's cache-on and cache-off runs alternating at each load, in one server process."""
    a, st = b.args, b.st
    with tempfile.TemporaryDirectory(prefix="kvfuse-bench-multiround-") as tmp:
        config = {
            "model": a.model,
            "cache": {
                "disk": True,
                "disk_path": str(Path(tmp) / "kv"),
                "memory_bytes": st["tier_bytes"],
                "eviction": "queue",
                "prefetch": True,
                "history": True,
            },
            "engine": {"kv_memory_bytes": st["kv_bytes"] - st["tier_bytes"]},
            "server": {"max_queue": 256, "max_tokens_limit": 1024},
        }
        log = srvs.log_path(a, b.name, "kvfuse")
        t0 = time.perf_counter()
        with srvs.kvfuse_process(a, config, log, b.meta) as srv:
            b.meta["kvfuse_startup_s"] = round(time.perf_counter() - t0, 1)
            print(
                f"kvfuse serve up in {b.meta['kvfuse_startup_s']} s (pid {srv.pid}, log {log})",
                file=sys.stderr,
            )
            driver = Driver(srv.base_url, a.model, b.ignore_eos)
            warm_up(driver.runner, max(b.workloads))
            kvfuse_loads(b, driver, srv.url, st["modes"])


def kvfuse_loads(b: Bench, driver: Driver, url: str, modes: list[bool]) -> None:
    failed = {c: False for c in modes}
    for i, (u, wl) in enumerate(sorted(b.workloads.items())):
        for cache in order(modes, i, alternate=True):  # alternate which mode runs first
            if failed[cache]:
                continue
            series = "kvfuse-on" if cache else "kvfuse-off"
            salt = f"multiround-{series}-{u}-{time.time_ns()}"
            warm_s = driver.warm(wl, salt) if cache else None
            before = kvfuse_metrics(url)
            point, texts = timed_run(b, driver, wl, series, cache, salt, i)
            m = delta(kvfuse_metrics(url), before)
            point.metrics = {"kvfuse": m, "split": time_split(m, point.requests)}
            point.warm_s = _r(warm_s, 1)
            b.record(point, texts)
            failed[cache] = not passes(asdict(point), b.args.bound)


def timed_run(b: Bench, driver: Driver, wl: Workload, series: str, cache: bool, salt: str, i: int):
    a = b.args
    return driver.run(wl, series, cache, salt, a.bound, a.stop_early and i > 0, a.max_point_s)


def cache_on_loads(b: Bench, series: str, first, scrape, fresh=None) -> None:
    """A cache-on series (vLLM, llama.cpp) over the loads upwards, stopping after the first that
    fails: before each, ``fresh`` (llama.cpp: a new server, warmed up) or nothing; the users'
    earlier chats sent once; the timed run with ``scrape``'s metric deltas around it."""
    driver = None
    for i, (u, wl) in enumerate(sorted(b.workloads.items())):
        driver = fresh() if fresh is not None else driver or first()
        salt = f"multiround-{series}-{u}-{time.time_ns()}"
        warm_s = driver.warm(wl, salt)
        url = driver.url
        before = scrape(url)
        point, texts = timed_run(b, driver, wl, series, True, salt, i)
        point.metrics = {series: delta(scrape(url), before)}
        point.warm_s = _r(warm_s, 1)
        b.record(point, texts)
        if not passes(asdict(point), b.args.bound):
            break


def run_vllm(b: Bench) -> None:
    a = b.args
    extra = ["--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(b.st["kv_bytes"])]
    log = srvs.log_path(a, b.name, "vllm")
    srv, env = srvs.vllm_process(a, extra, log)
    b.meta["vllm_command"] = " ".join(srv.cmd)
    b.meta["vllm_env"] = env
    print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
    with srv:
        m = b.meta
        m["vllm_startup_s"] = round(srv.startup_s, 1)
        m["vllm_kv_cache"] = srv.log_lines("KV cache size", "for KV cache", "num_gpu_blocks")
        m["vllm_cpu_binding"] = srv.log_lines("core ids=", "reserved_cpus=", "Torch threads")
        m["vllm_prefix_caching"] = srv.prefix_caching_logged()
        m["vllm_accepts_ignore_eos"] = srvs.require_ignore_eos(srv.url, b.ignore_eos, "vLLM")
        print(f"vLLM up in {srv.startup_s:.0f} s (pid {srv.pid})", file=sys.stderr)

        def first() -> Driver:
            driver = Driver(srv.base_url, a.model, b.ignore_eos)
            warm_up(driver.runner, max(b.workloads))
            return driver

        cache_on_loads(b, "vllm", first, vllm_metrics)


def run_llama(b: Bench) -> None:
    """llama.cpp's server: a fresh one for each load (a cold prompt cache), a slot per user."""
    a = b.args
    ctx = b.st["kv_bytes"] // kv_bytes_per_token(b.model_dir, 2)
    log = srvs.log_path(a, b.name, "llama.cpp")
    users = max(b.workloads)
    with srvs.llama_process(a, ctx, users, log) as srv:
        srvs.llama_meta(srv, b.meta)
        b.meta["llama_accepts_ignore_eos"] = srvs.require_ignore_eos(
            srv.url, b.ignore_eos, "llama-server"
        )
        print(
            f"llama-server up in {srv.startup_s:.1f} s (pid {srv.pid}, log {log})", file=sys.stderr
        )

        def fresh() -> Driver:
            srv.restart()
            driver = Driver(srv.base_url, a.model, b.ignore_eos)
            warm_up(driver.runner, users)
            srv.erase_slots()
            return driver

        cache_on_loads(b, "llama.cpp", None, llama_metrics, fresh)


# ----------------------------------------------------------------------------------------- main


def settings(p, args) -> dict:
    """The run's resolved settings (``--quick`` fills what was not given)."""
    q = args.quick
    kv_bytes, tier_bytes = int(args.kv_mib * 2**20), int(args.kvfuse_tier_mib * 2**20)
    if not 0 < tier_bytes < kv_bytes:
        p.error("--kvfuse-tier-mib must be within (0, --kv-mib)")
    return {
        "users": sorted(set(args.users or ([2, 4] if q else [2, 4, 8, 16]))),
        "rounds": args.rounds or (2 if q else 4),
        "answer": args.answer_tokens or (16 if q else 64),
        "think": args.think if args.think is not None else (1.0 if q else 4.0),
        "prior": args.prior_chars if args.prior_chars is not None else (1500 if q else 3000),
        "servers": srvs.servers(p, args),
        "modes": {"both": [True, False], "on": [True], "off": [False]}[args.cache],
        "name": output_name("multiround", args.tag, q),
        "kv_bytes": kv_bytes,
        "tier_bytes": tier_bytes,
    }


class Bench:
    """One invocation: its workloads (one per user count), the points measured, the JSON saved
    after every point."""

    def __init__(self, args, argv, st: dict):
        self.args, self.st = args, st
        self.name, self.servers = st["name"], st["servers"]
        system = system_prompt(args.system_words)
        self.convs = load_conversations(args.sharegpt)
        self.workloads = {
            u: build_workload(
                *(self.convs, system, u, st["rounds"], st["answer"], st["think"]),
                *(args.stagger, args.question_chars, st["prior"], args.seed),
            )
            for u in st["users"]
        }
        self.model_dir = srvs.model_folder(args.home, args.model)
        kvfuse_eos = kvfuse_accepts_ignore_eos()
        self.ignore_eos = {"on": True, "off": False, "auto": kvfuse_eos}[args.ignore_eos]
        self.meta = self.describe(argv)
        self.points: list[dict] = []
        self.outputs: dict[str, dict[str, str]] = {}
        self.t_start = time.perf_counter()

    def describe(self, argv) -> dict:
        a, st = self.args, self.st
        fp32, fp16 = kv_bytes_per_token(self.model_dir, 4), kv_bytes_per_token(self.model_dir, 2)
        kv, tier = st["kv_bytes"], st["tier_bytes"]
        return {
            "mode": "quick" if a.quick else "full",
            "model": a.model,
            "servers": self.servers,
            "users": st["users"],
            "rounds": st["rounds"],
            "answer_tokens": st["answer"],
            "think_mean_s": st["think"],
            "think_cap_s": 3 * st["think"],
            "stagger_s": a.stagger,
            "system_words": a.system_words,
            "question_chars": a.question_chars,
            "prior_chars": st["prior"],
            "seed": a.seed,
            "bound_s": a.bound,
            "stop_early": a.stop_early,
            "ignore_eos": self.ignore_eos,
            "data": f"system prompt: MuSiQue dev documents (examples 0-49 of musique_s.json); questions: "
            f"{a.sharegpt.name} (dev file), {len(self.convs)} conversations with >= {st['rounds']} user turns",
            **token_counts(self.model_dir, self.workloads),
            "kv_ram_bytes": kv,
            "kv_tokens": {
                "vllm": kv // fp32,
                "kvfuse_live": (kv - tier) // fp16,
                "kvfuse_memory_tier": tier // fp16,
            },
            "kv_sizes": kv_sizes(kv, tier, fp32, fp16, "llama.cpp" in self.servers),
            "ttft": "client-side: request sent -> first streamed content token",
            "request": "streamed chat completion with the whole history; prompt_cache_key per user, cache_salt per run; "
            "kvfuse cache off: cache: false",
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(
                ["bench/multiround.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "failures": [],
        }

    def series(self) -> dict[str, list[dict]]:
        return split_series(self.points)

    def save(self) -> None:
        self.meta["total_s"] = round(time.perf_counter() - self.t_start, 1)
        result = {
            "meta": self.meta,
            "points": self.points,
            "comparison": comparison(self.series(), self.args.bound),
            "agreement": agreement(self.points, self.outputs),
            "outputs": self.outputs,
        }
        write_json(self.name, result)

    def record(self, point: Point, texts: dict[str, str]) -> None:
        d = asdict(point)
        self.points.append(d)
        self.outputs[f"{point.series}|{point.users}"] = texts
        print_point(point, d["metrics"].get("split", {}))
        self.save()

    def run_all(self) -> None:
        run = {"kvfuse": run_kvfuse, "vllm": run_vllm, "llama.cpp": run_llama}
        for server in self.servers:
            try:
                run[server](self)
            except Exception as e:  # keep what the other server measured
                self.meta["failures"].append(f"{server}: {type(e).__name__}: {e}"[:2000])
                print(f"{server} failed: {e}", file=sys.stderr)
            self.save()

    def finish(self) -> int:
        st, a = self.st, self.args
        series = self.series()
        cmp_ = comparison(series, a.bound)
        print_results(self.points, cmp_, agreement(self.points, self.outputs), self.meta)
        title = (
            f"{a.model}, {st['rounds']} rounds per user, {st['answer']}-token answers, "
            f"KV RAM {a.kv_mib:g} MiB per server ({os.cpu_count()} CPU cores)"
        )
        plot(series, cmp_, plot_path(self.name), title)
        print(
            f"wrote {stem(self.name)}.json and {self.name}.png "
            f"({time.perf_counter() - self.t_start:.0f} s)",
            file=sys.stderr,
        )
        return 1 if self.meta["failures"] else 0


def kv_sizes(kv: int, tier: int, fp32: int, fp16: int, llama: bool) -> dict[str, str]:
    out = {
        "vllm": f"--kv-cache-memory-bytes {kv} (fp32 KV, {fp32} B/token: {kv // fp32} "
        f"tokens, paged, shared prefixes stored once)",
        "kvfuse": f"engine.kv_memory_bytes {kv - tier} (live, fp16 KV, {fp16} B/token: "
        f"{(kv - tier) // fp16} tokens, one cache per running sequence) + "
        f"cache.memory_bytes {tier} (memory tier: {tier // fp16} tokens) + "
        f"the disk tier (a temp folder)",
    }
    if llama:
        out["llama.cpp"] = (
            f"--ctx-size {kv // fp16} (f16 KV, {fp16} B/token, --kv-unified: shared by the "
            f"slots) + its host-RAM prompt cache (--cache-ram, llama.cpp's default)"
        )
    return out


def split_series(points: list[dict]) -> dict[str, list[dict]]:
    return {
        s: [p for p in points if p["series"] == s]
        for s in SERIES
        if any(p["series"] == s for p in points)
    }


def print_point(point: Point, split: dict) -> None:
    print(
        f"  {LABELS[point.series]:<34} users={point.users:<3} {point.requests}/{point.planned} requests"
        f"{' (cut)' if point.cut else ''}, {point.errors} errors, {point.wall_s:.0f} s, TTFT p50/p95 "
        f"{_s(point.ttft_p50_s)}/{_s(point.ttft_p95_s)} s, {point.output_tokens_per_s:.1f} tok/s, "
        f"in flight {point.mean_active:.1f}, history {point.history_tokens_end} tokens"
        + (
            f", queue {_s(split.get('queue_wait_s'))} s, engine TTFT {_s(split.get('engine_ttft_s'))} s, "
            f"prefilled {split.get('prefilled_tokens_per_request')}/req"
            if split
            else ""
        ),
        file=sys.stderr,
    )
    if point.error_samples:
        print(f"    errors: {point.error_samples}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.replot:
        return replot(output_name("multiround", args.tag, args.quick))
    st = settings(p, args)
    bench = Bench(args, argv, st)
    print(
        f"workload: users {st['users']} x {st['rounds']} rounds, {st['answer']}-token answers, "
        f"think ~Exp({st['think']:g} s), system prompt {args.system_words} words; bound p95 TTFT "
        f"<= {args.bound:g} s; KV RAM {args.kv_mib:g} MiB each",
        file=sys.stderr,
    )
    bench.run_all()
    return bench.finish()


def replot(name: str) -> int:
    """Tables and plot again from ``docs/bench/<name>.json``; derived fields recomputed from the measurements."""
    path = plot_path(name).with_suffix(".json")
    data = json.loads(path.read_text())
    meta, points, outputs = data["meta"], data["points"], data["outputs"]
    for p in points:
        p["cut"] = p["requests"] + p["errors"] < p["planned"]
    series = split_series(points)
    cmp_ = comparison(series, meta["bound_s"])
    agree = agreement(points, outputs)
    meta["replotted"] = _dt.datetime.now().isoformat(timespec="seconds")
    new = {**data, "meta": meta, "points": points, "comparison": cmp_, "agreement": agree}
    write_json(path, new, add_environment=False)
    print_results(points, cmp_, agree, meta)
    title = (
        f"{meta['model']}, {meta['rounds']} rounds per user, {meta['answer_tokens']}"
        f"-token answers, KV RAM {meta['kv_ram_bytes'] / 2**20:g} MiB per server ({os.cpu_count()} CPU cores)"
    )
    plot(series, cmp_, plot_path(name), title)
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# -------------------------------------------------------------------------------------- report


def _first_round(texts: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in texts.items() if k.endswith("/r1")}


def agreement(points: list[dict], outputs: dict[str, dict[str, str]]) -> list[dict]:
    """Answers identical to kvfuse cache off's at the same load, per series and load; then kvfuse
    cache on's against vLLM's and llama.cpp's at the loads they share."""
    out = []
    for p in points:
        if p["series"] == "kvfuse-off":
            continue
        ref = outputs.get(f"kvfuse-off|{p['users']}")
        mine = outputs.get(f"{p['series']}|{p['users']}")
        if ref is None or mine is None:
            continue
        out.append(agree_row(p["series"], p["users"], "kvfuse-off", mine, ref))
    for other in ("vllm", "llama.cpp"):
        theirs = {p["users"] for p in points if p["series"] == other}
        for p in points:
            if p["series"] == "kvfuse-on" and p["users"] in theirs:
                a, b = outputs.get(f"kvfuse-on|{p['users']}"), outputs.get(f"{other}|{p['users']}")
                if a and b:
                    out.append(agree_row("kvfuse-on", p["users"], other, a, b))
    return out


def agree_row(series: str, users: int, vs: str, mine: dict, ref: dict) -> dict:
    return {
        "series": series,
        "users": users,
        "vs": vs,
        "same_answers": same_answers(mine, ref),
        "same_round1": same_answers(_first_round(mine), ref),
    }


def unique_history(p: dict, system_tokens: int) -> int:
    """All users' chats at the end of a run, the shared system prompt counted once."""
    return max(0, p["history_tokens_end"] - (p["users"] - 1) * system_tokens)


POINT_HEADERS = [
    "server",
    "users",
    "rounds",
    "load",
    "requests",
    "TTFT p50 s",
    "p95 s",
    "p95 r1",
    "p95 r>=2",
    "out tok/s",
    "reused",
    "history tok (x vLLM KV / x kvfuse mem)",
]


def point_row(p: dict, meta: dict, bound_s: float) -> list:
    kv = meta["kv_tokens"]
    hist = unique_history(p, meta["system_tokens"])
    return [
        LABELS[p["series"]],
        p["users"],
        p["rounds"],
        p["load"],
        f"{p['requests']}/{p['planned']}" + (" cut" if p["cut"] else ""),
        _s(p["ttft_p50_s"]),
        ("≥" if p["cut"] else "") + _s(p["ttft_p95_s"]),
        _s(p["ttft_p95_round1_s"]),
        _s(p["ttft_p95_later_s"]),
        p["output_tokens_per_s"],
        f"{p['cached_tokens'] / max(1, p['prompt_tokens']):.0%}"
        if p["cached_tokens"] is not None
        else "-",
        f"{hist} ({hist / kv['vllm']:.1f}x / {hist / (kv['kvfuse_live'] + kv['kvfuse_memory_tier']):.1f}x)",
        "pass" if passes(p, bound_s) else "FAIL",
    ]


def print_results(points: list[dict], cmp_: dict, agree: list[dict], meta: dict) -> None:
    kv, bound = meta["kv_tokens"], cmp_["bound_s"]
    print()
    print_table([*POINT_HEADERS, f"p95<={bound:g}s"], [point_row(p, meta, bound) for p in points])
    print(
        f"KV RAM {meta['kv_ram_bytes'] / 2**20:g} MiB each: vLLM {kv['vllm']} tokens (fp32); kvfuse "
        f"{kv['kvfuse_live']} live + {kv['kvfuse_memory_tier']} in the memory tier (fp16), then disk. History: "
        f"every user's chat at the end of the run, the {meta['system_tokens']}-token system prompt counted once."
    )
    print_scores(cmp_)
    print_split(points)
    if agree:
        print("\nsame answers (greedy), against the other series at the same load")
        print_table(
            ["series", "users", "vs", "same answers", "same round-1 answers"],
            [
                [
                    LABELS[a["series"]],
                    a["users"],
                    LABELS[a["vs"]],
                    a["same_answers"],
                    a["same_round1"],
                ]
                for a in agree
            ],
        )


def print_scores(cmp_: dict) -> None:
    print()
    print(
        f"score: the largest users x rounds with p95 TTFT <= {cmp_['bound_s']:g} s at it and every smaller load"
    )
    for s, v in cmp_["scores"].items():
        print(
            f"  {LABELS[s]:<34} {v['load'] if v['load'] is not None else 'none'}"
            + (f" ({v['users']} users x {v['rounds']} rounds)" if v["load"] is not None else "")
            + (f"; first failing load {v['first_fail']}" if v["first_fail"] is not None else "")
        )
    if "reference_load" not in cmp_:
        return
    print(f"p95 TTFT at {cmp_['reference']} ({cmp_['reference_load']}):")
    for s, v in cmp_["p95_at_reference_s"].items():
        print(f"  {LABELS[s]:<34} {_s(v)} s")
    if "vllm_over_kvfuse_p95" in cmp_:
        t = cmp_["target"]
        print(
            f"  vLLM / kvfuse = {cmp_['vllm_over_kvfuse_p95']}x; target (kvfuse serves more: "
            f"{t['kvfuse_serves_more']}, p95 >= 3x lower: {t['p95_3x_lower']}): {'MET' if t['met'] else 'not met'}"
        )


def split_row(p: dict) -> list:
    k = p["metrics"]["kvfuse"]
    return [
        p["users"],
        *p["metrics"]["split"].values(),
        " ".join(
            f"{name[len('reused_chunks_') :]}:{int(v)}"
            for name, v in k.items()
            if name.startswith("reused_chunks_") and v
        )
        or "-",
        f"{int(k.get('prefetch_hits', 0))}/{int(k.get('prefetch_misses', 0))}",
        int(k.get("preemptions", 0)),
        int(k.get("memory_evictions", 0)),
    ]


def print_split(points: list[dict]) -> None:
    rows = [
        split_row(p) for p in points if p["series"] == "kvfuse-on" and p["metrics"].get("split")
    ]
    if not rows:
        return
    print("\nwhere kvfuse's time goes (cache on; /metrics deltas, means per request)")
    print_table(
        [
            "users",
            "queue wait s",
            "engine TTFT s",
            "decode s/token",
            "prefilled tok/req",
            "reused share",
            "seqs/step",
            "chunks reused by tier",
            "prefetch hit/miss",
            "preemptions",
            "mem evictions",
        ],
        rows,
    )


STYLES = {
    "kvfuse-on": ("-o", "tab:blue"),
    "kvfuse-off": ("--s", "tab:cyan"),
    "vllm": ("-^", "tab:red"),
    "llama.cpp": ("-D", "tab:orange"),
}


def plot(series: dict[str, list[dict]], cmp_: dict, path: Path, title: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for s, pts in series.items():
        plot_series(a, b, s, sorted(pts, key=lambda p: p["load"]))
    a.axhline(cmp_["bound_s"], color="k", lw=1, ls=":", label=f"bound {cmp_['bound_s']:g} s")
    loads = sorted({p["load"] for pts in series.values() for p in pts})
    for ax, ylabel, ttl in (
        (a, "TTFT (s, log)", "p95 time to first token (faint: p50)"),
        (b, "output tokens/s", "throughput"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(x) for x in loads])
        ax.minorticks_off()
        ax.set(xlabel="load: users x rounds", ylabel=ylabel, title=ttl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    log_axis(a)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    save_figure(fig, path)


def plot_series(a, b, s: str, pts: list[dict]) -> None:
    style, color = STYLES[s]
    p95 = [p for p in pts if p["ttft_p95_s"] is not None]
    p50 = [p for p in pts if p["ttft_p50_s"] is not None]
    a.plot(
        [p["load"] for p in p95],
        [p["ttft_p95_s"] for p in p95],
        style,
        color=color,
        label=LABELS[s],
    )
    a.plot(
        [p["load"] for p in p50],
        [p["ttft_p50_s"] for p in p50],
        ":",
        marker=style[-1],
        color=color,
        alpha=0.4,
        markersize=4,
    )
    for p in pts:
        if p["cut"] and p["ttft_p95_s"] is not None:
            a.annotate(
                "cut (≥)",
                (p["load"], p["ttft_p95_s"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=color,
            )
    b.plot(
        [p["load"] for p in pts],
        [p["output_tokens_per_s"] for p in pts],
        style,
        color=color,
        label=LABELS[s],
    )


def log_axis(a) -> None:
    """A log y axis labelled at 1, 2, 3, 5 of each decade."""
    import matplotlib.ticker

    a.set_yscale("log")
    a.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    a.yaxis.set_minor_formatter(
        matplotlib.ticker.FuncFormatter(
            lambda v, _: (
                f"{v:g}"
                if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 3, 5)
                else ""
            )
        )
    )


def build_parser():
    p = parser(
        __doc__,
        ("quick", {"help": "smoke run: users 2 4, 2 rounds, 16-token answers, short think"}),
        ("rounds", {"default": None, "help": "rounds per user (default 4; quick: 2)"}),
        ("tag", {"help": "output name docs/bench/multiround-TAG.{json,png}"}),
    )
    srvs.add_server_flags(p, "multiround")
    p.add_argument(
        "--cache", choices=("both", "on", "off"), default="both", help="kvfuse cache modes to run"
    )
    p.add_argument(
        "--users",
        type=int,
        nargs="+",
        help="user counts swept upwards (default 2 4 8 16; quick: 2 4)",
    )
    _workload_flags(p)
    _method_flags(p)
    p.add_argument(
        "--replot",
        action="store_true",
        help="run nothing: read the output JSON back, recompute the "
        "derived fields (cut, scores, agreement), print the tables and redraw the plot",
    )
    return p


def _workload_flags(p) -> None:
    add = p.add_argument
    add("--answer-tokens", type=int, help="tokens per answer, ignore_eos (default 64; quick: 16)")
    add(
        "--think",
        type=float,
        help="mean think time between a user's rounds, s, exponential "
        "(capped at 3x; default 4; quick: 1)",
    )
    add(
        "--stagger",
        type=float,
        default=1.0,
        help="user i starts i * stagger s into the run (default 1)",
    )
    add(
        "--system-words",
        type=int,
        default=620,
        help="words of the shared system prompt (default 620: ~1,000 SmolLM2 tokens)",
    )
    add("--question-chars", type=int, default=600, help="each question cut to this many characters")
    add(
        "--prior-chars",
        type=int,
        help="characters of each user's earlier chat (recorded exchanges, "
        "~4 characters a token; default 3000; quick: 1500)",
    )
    add("--seed", type=int, default=0, help="orders the conversations and draws think times")
    add("--sharegpt", type=Path, default=DATA / "sharegpt_multiturn_dev.jsonl")


def _method_flags(p) -> None:
    add = p.add_argument
    add(
        "--bound",
        type=float,
        default=2.0,
        help="the p95 TTFT bound of the score, seconds (default 2)",
    )
    add(
        "--kv-mib",
        type=float,
        default=768,
        help="KV RAM of each server, MiB (default 768): vLLM's whole KV space; kvfuse's live KV "
        "budget plus its memory tier; llama.cpp's --ctx-size (f16 KV)",
    )
    add(
        "--kvfuse-tier-mib",
        type=float,
        default=64,
        help="of --kv-mib, kvfuse's memory tier (default 64); "
        "the rest is its live KV budget (engine.kv_memory_bytes)",
    )
    add(
        "--no-stop-early",
        dest="stop_early",
        action="store_false",
        help="run every round of every load (by default a run after a series' first stops once its p95 "
        "can no longer pass: its p95 is then a lower bound)",
    )
    add(
        "--max-point-s",
        type=float,
        default=240,
        help="a run sends no new round after this many s (a guard: such a run counts as failing)",
    )


if __name__ == "__main__":
    sys.exit(main())
