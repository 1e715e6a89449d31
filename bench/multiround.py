"""Multi-round chat at scale: N users, R rounds each, a shared system prompt, think time between
rounds, histories that outgrow the KV memory. kvfuse (memory + disk tiers, history reuse,
prefetch) vs vLLM CPU (its prefix cache in its KV space) vs kvfuse with the cache off: TTFT
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
load or store), then vLLM runs the same loads. A series stops after its first load whose p95
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

Results: ``docs/bench/multiround.json`` and ``docs/bench/multiround.png`` (``--quick``:
``multiround-quick.*``, a smoke run of 1-2 minutes per server; ``--tag T``: ``multiround-T.*``).

    KVFUSE_HOME=... .venv/bin/python bench/multiround.py   # ~20 min on an idle machine, vLLM start-up included
    KVFUSE_HOME=... .venv/bin/python bench/multiround.py --quick --servers kvfuse
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from serve import deep_merge, kvfuse_accepts_ignore_eos, percentile, server_accepts

from bench.common import DATA, musique, plot_path, print_table, write_json

SERIES = ("kvfuse-on", "kvfuse-off", "vllm")
LABELS = {
    "kvfuse-on": "kvfuse (memory + disk, prefetch)",
    "kvfuse-off": "kvfuse cache off",
    "vllm": "vLLM CPU (prefix caching)",
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


def kv_bytes_per_token(model_dir: Path, bytes_per_value: int) -> int:
    """K and V of one token over every layer, from the HF folder's config.json."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return (
        c["num_hidden_layers"]
        * 2
        * c.get("num_key_value_heads", c["num_attention_heads"])
        * head_dim
        * bytes_per_value
    )


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
        from serve import Runner

        self.runner = Runner(base_url, model, "multiround", ignore_eos)
        self.ignore_eos = ignore_eos

    def extra(self, cache: bool, salt: str, user: str | None = None) -> dict:
        extra: dict = {"cache_salt": salt} if cache else {"cache": False}
        if self.ignore_eos:
            extra["ignore_eos"] = True
        if user is not None:
            extra["prompt_cache_key"] = f"{salt}/{user}"
        return extra

    def warm(self, wl: Workload, salt: str, clients: int = 4) -> float:
        """Untimed: each user's earlier chat (system prompt and earlier exchanges) sent once, one
        token answered, so that the server has it as a user returning to a conversation finds it.
        User 0 first (the shared system prompt), then the others ``clients`` at a time, in user
        order. The seconds it took."""
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()

        def one(u: User) -> None:
            self.runner._stream(self.extra(True, salt, u.name), 1, messages=opening(wl, u))

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
        point = Point(series, len(wl.users), wl.rounds, wl.load, wl.load)
        samples: list[dict] = []
        outputs: dict[str, str] = {}
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        active = [0]
        active_area = [
            0.0,
            time.perf_counter(),
        ]  # integral of in-flight requests over time, last change
        history_end: dict[str, int] = {}
        t0 = time.perf_counter()

        def inflight(delta: int) -> None:
            with lock:
                now = time.perf_counter()
                active_area[0] += active[0] * (now - active_area[1])
                active_area[1] = now
                active[0] += delta

        def user(u: User) -> None:
            if stop.wait(u.start_s):
                return
            msgs = opening(wl, u)
            for r, q in enumerate(u.questions):
                if stop.is_set() or time.perf_counter() - t0 > max_wall_s:
                    return
                msgs.append({"role": "user", "content": q})
                sent = time.perf_counter() - t0
                inflight(+1)
                try:
                    s = self.runner._stream(
                        self.extra(cache, salt, u.name), wl.answer_tokens, messages=list(msgs)
                    )
                except (
                    Exception
                ) as e:  # counted and reported; this user stops (its history is broken)
                    with lock:
                        errors.append(f"{u.name}/r{r + 1}: {type(e).__name__}: {e}"[:300])
                    return
                finally:
                    inflight(-1)
                s.update(user=u.name, round=r + 1, sent_s=sent)
                with lock:
                    samples.append(s)
                    outputs[f"{u.name}/r{r + 1}"] = s["text"]
                    if s["prompt_tokens"] is not None:
                        history_end[u.name] = s["prompt_tokens"] + s["completion_tokens"]
                    point.over_bound += s["ttft"] > bound_s
                    if stop_early and p95_cannot_pass(point.over_bound, point.planned):
                        stop.set()  # no new rounds; the run is "cut" if requests were left unsent
                msgs.append({"role": "assistant", "content": s["text"]})
                if r < len(u.think_s) and stop.wait(u.think_s[r]):
                    return

        point.ran_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        load_before = os.getloadavg()[0]
        threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in wl.users]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        inflight(0)
        ttft = [s["ttft"] for s in samples]
        first = [s["ttft"] for s in samples if s["round"] == 1]
        later = [s["ttft"] for s in samples if s["round"] > 1]
        cached = [s["cached"] for s in samples if s["cached"] is not None]
        out_tokens = sum(s["completion_tokens"] or 0 for s in samples)
        point.requests, point.errors, point.error_samples = len(samples), len(errors), errors[:3]
        point.cut = len(samples) + len(errors) < point.planned
        point.wall_s = round(wall, 2)
        point.ttft_p50_s, point.ttft_p95_s = _r(percentile(ttft, 0.5)), _r(percentile(ttft, 0.95))
        point.ttft_max_s = _r(max(ttft)) if ttft else None
        point.ttft_p95_round1_s, point.ttft_p95_later_s = (
            _r(percentile(first, 0.95)),
            _r(percentile(later, 0.95)),
        )
        point.latency_p50_s = _r(percentile([s["latency"] for s in samples], 0.5))
        point.output_tokens = out_tokens
        point.output_tokens_per_s = round(out_tokens / wall, 2) if wall > 0 else 0.0
        point.prompt_tokens = sum(s["prompt_tokens"] or 0 for s in samples)
        point.cached_tokens = sum(cached) if cached else None
        point.history_tokens_end = sum(history_end.values())
        point.mean_active = round(active_area[0] / wall, 2) if wall > 0 else 0.0
        point.loadavg = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        return point, outputs


def same_answers(a: dict[str, str], b: dict[str, str]) -> str | None:
    both = sorted(set(a) & set(b))
    return f"{sum(a[k] == b[k] for k in both)}/{len(both)}" if both else None


# ------------------------------------------------------------------------------------- metrics


def kvfuse_metrics(url: str) -> dict[str, float]:
    """The kvfuse counters that say where a run's time went (summed over labels where noted)."""
    from vllm_server import metric_total, scrape_metrics

    s = scrape_metrics(url)
    out = {
        "queue_wait_s": metric_total(s, "kvfuse_queue_wait_seconds_sum"),
        "queue_wait_n": metric_total(s, "kvfuse_queue_wait_seconds_count"),
        "engine_ttft_s": metric_total(s, "kvfuse_time_to_first_token_seconds_sum"),
        "engine_ttft_n": metric_total(s, "kvfuse_time_to_first_token_seconds_count"),
        "tpot_s": metric_total(s, "kvfuse_time_per_output_token_seconds_sum"),
        "tpot_n": metric_total(s, "kvfuse_time_per_output_token_seconds_count"),
        "prompt_cached": metric_total(s, "kvfuse_prompt_tokens_total", source="cached"),
        "prompt_prefilled": metric_total(s, "kvfuse_prompt_tokens_total", source="prefilled"),
        "history_reused_tokens": metric_total(s, "kvfuse_history_reused_tokens_total"),
        "preemptions": metric_total(s, "kvfuse_preemptions_total"),
        "steps": metric_total(s, "kvfuse_engine_steps_total"),
        "step_sequences": metric_total(s, "kvfuse_batch_sequences_sum"),
        "step_tokens": metric_total(s, "kvfuse_batch_tokens_sum"),
        "prefetch_hits": metric_total(s, "kvfuse_prefetch_hits_total"),
        "prefetch_misses": metric_total(s, "kvfuse_prefetch_misses_total"),
        "prefetched_chunks": metric_total(s, "kvfuse_prefetched_chunks_total"),
        "memory_evictions": metric_total(s, "kvfuse_tier_evictions_total", tier="memory"),
        "protected_evictions": metric_total(
            s, "kvfuse_tier_protected_evictions_total", tier="memory"
        ),
        "save_waits": metric_total(s, "kvfuse_save_waits_total"),
        "save_wait_s": metric_total(s, "kvfuse_save_wait_seconds_total"),
        "kv_memory_peak_bytes": metric_total(s, "kvfuse_kv_memory_peak_bytes"),
    }
    for name, lab, v in s:
        if name == "kvfuse_reused_chunks_total":
            out[f"reused_chunks_{lab.get('tier', '?')}"] = v
    return out


def vllm_metrics(url: str) -> dict[str, float]:
    from vllm_server import metric_total, scrape_metrics

    s = scrape_metrics(url)
    names = {n for n, _, _ in s}

    def total(*candidates: str) -> float:
        return next((metric_total(s, n) for n in candidates if n in names), 0.0)

    return {
        "prefix_cache_queries": total(
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"
        ),
        "prefix_cache_hits": total("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
        "preemptions": total("vllm:num_preemptions_total", "vllm:num_preemptions"),
        "prompt_tokens": total("vllm:prompt_tokens_total"),
        "queue_s": total("vllm:request_queue_time_seconds_sum"),
        "queue_n": total("vllm:request_queue_time_seconds_count"),
        "prefill_s": total("vllm:request_prefill_time_seconds_sum"),
        "prefill_n": total("vllm:request_prefill_time_seconds_count"),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    gauges = {"kv_memory_peak_bytes"}
    return {k: round(v if k in gauges else v - before.get(k, 0.0), 4) for k, v in after.items()}


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


# ----------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: users 2 4, 2 rounds, 16-token answers, short think",
    )
    p.add_argument(
        "--servers", default="kvfuse,vllm", help="comma-separated, run in this order: kvfuse, vllm"
    )
    p.add_argument(
        "--cache", choices=("both", "on", "off"), default="both", help="kvfuse cache modes to run"
    )
    p.add_argument(
        "--users",
        type=int,
        nargs="+",
        help="user counts swept upwards (default 2 4 8 16; quick: 2 4)",
    )
    p.add_argument("--rounds", type=int, help="rounds per user (default 4; quick: 2)")
    p.add_argument(
        "--answer-tokens", type=int, help="tokens per answer, ignore_eos (default 64; quick: 16)"
    )
    p.add_argument(
        "--think",
        type=float,
        help="mean think time between a user's rounds, s, exponential "
        "(capped at 3x; default 4; quick: 1)",
    )
    p.add_argument(
        "--stagger",
        type=float,
        default=1.0,
        help="user i starts i * stagger s into the run (default 1)",
    )
    p.add_argument(
        "--system-words",
        type=int,
        default=620,
        help="words of the shared system prompt (default 620: ~1,000 SmolLM2 tokens)",
    )
    p.add_argument(
        "--question-chars", type=int, default=600, help="each question cut to this many characters"
    )
    p.add_argument(
        "--prior-chars",
        type=int,
        help="characters of each user's earlier chat (recorded exchanges, "
        "~4 characters a token; default 3000; quick: 1500)",
    )
    p.add_argument(
        "--bound",
        type=float,
        default=2.0,
        help="the p95 TTFT bound of the score, seconds (default 2)",
    )
    p.add_argument(
        "--kv-mib",
        type=float,
        default=768,
        help="KV RAM of each server, MiB (default 768): vLLM's whole "
        "KV space; kvfuse's live KV budget plus its memory tier",
    )
    p.add_argument(
        "--kvfuse-tier-mib",
        type=float,
        default=64,
        help="of --kv-mib, kvfuse's memory tier (default 64); "
        "the rest is its live KV budget (engine.kv_memory_bytes)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="orders the conversations and draws think times"
    )
    p.add_argument(
        "--no-stop-early",
        dest="stop_early",
        action="store_false",
        help="run every round of every load (by default a run after a series' first stops once its p95 "
        "can no longer pass: its p95 is then a lower bound)",
    )
    p.add_argument(
        "--max-point-s",
        type=float,
        default=240,
        help="a run sends no new round after this many s (a guard: such a run counts as failing)",
    )
    p.add_argument("--sharegpt", type=Path, default=DATA / "sharegpt_multiturn_dev.jsonl")
    p.add_argument(
        "--home", default=os.environ.get("KVFUSE_HOME") or str(Path.home() / ".cache" / "kvfuse")
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--ignore-eos",
        choices=("auto", "on", "off"),
        default="auto",
        help="send ignore_eos: auto = only if every server accepts it",
    )
    p.add_argument(
        "--kvfuse-config",
        type=Path,
        metavar="YAML",
        help="kvfuse: a config merged over the benchmark's",
    )
    p.add_argument(
        "--kvfuse-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="kvfuse: extra serve flags",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="vLLM's venv python (default .baselines/vllm-venv/bin/python)",
    )
    p.add_argument(
        "--vllm-model-path",
        type=Path,
        help="the HF folder vLLM serves (default <home>/models/<model>)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="vLLM: extra api_server flags",
    )
    p.add_argument(
        "--vllm-setup",
        choices=("tuned", "default"),
        default="tuned",
        help="vLLM CPU set-up: tuned (default; its CPU guide: tcmalloc and Intel OpenMP "
        "preloaded, no core reserved for HTTP: bench/vllm_server.tuned_env) or default (as installed)",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vLLM: extra environment",
    )
    p.add_argument("--tag", help="output name docs/bench/multiround-TAG.{json,png}")
    p.add_argument(
        "--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvfuse-bench-multiround"
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="run nothing: read the output JSON back, recompute the "
        "derived fields (cut, scores, agreement), print the tables and redraw the plot",
    )
    args = p.parse_args(argv)
    if args.replot:
        return replot(
            f"multiround-{args.tag}"
            if args.tag
            else "multiround-quick"
            if args.quick
            else "multiround"
        )

    q = args.quick
    users = sorted(set(args.users or ([2, 4] if q else [2, 4, 8, 16])))
    rounds = args.rounds or (2 if q else 4)
    answer = args.answer_tokens or (16 if q else 64)
    think = args.think if args.think is not None else (1.0 if q else 4.0)
    prior = args.prior_chars if args.prior_chars is not None else (1500 if q else 3000)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in servers:
        if s not in ("kvfuse", "vllm"):
            p.error(f"unknown server {s!r}")
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.cache]
    name = f"multiround-{args.tag}" if args.tag else "multiround-quick" if q else "multiround"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    kv_bytes = int(args.kv_mib * 2**20)
    tier_bytes = int(args.kvfuse_tier_mib * 2**20)
    if not 0 < tier_bytes < kv_bytes:
        p.error("--kvfuse-tier-mib must be within (0, --kv-mib)")

    system = system_prompt(args.system_words)
    convs = load_conversations(args.sharegpt)
    workloads = {
        u: build_workload(
            convs,
            system,
            u,
            rounds,
            answer,
            think,
            args.stagger,
            args.question_chars,
            prior,
            args.seed,
        )
        for u in users
    }
    from vllm_server import default_model_path

    model_dir = default_model_path(args.home, args.model)
    counts = token_counts(model_dir, workloads)
    fp32, fp16 = kv_bytes_per_token(model_dir, 4), kv_bytes_per_token(model_dir, 2)
    kvfuse_eos = kvfuse_accepts_ignore_eos()
    ignore_eos = {"on": True, "off": False, "auto": kvfuse_eos}[args.ignore_eos]
    meta = {
        "mode": "quick" if q else "full",
        "model": args.model,
        "servers": servers,
        "users": users,
        "rounds": rounds,
        "answer_tokens": answer,
        "think_mean_s": think,
        "think_cap_s": 3 * think,
        "stagger_s": args.stagger,
        "system_words": args.system_words,
        "question_chars": args.question_chars,
        "prior_chars": prior,
        "seed": args.seed,
        "bound_s": args.bound,
        "stop_early": args.stop_early,
        "ignore_eos": ignore_eos,
        "data": f"system prompt: MuSiQue dev documents (examples 0-49 of musique_s.json); questions: "
        f"{args.sharegpt.name} (dev file), {len(convs)} conversations with >= {rounds} user turns",
        **counts,
        "kv_ram_bytes": kv_bytes,
        "kv_tokens": {
            "vllm": kv_bytes // fp32,
            "kvfuse_live": (kv_bytes - tier_bytes) // fp16,
            "kvfuse_memory_tier": tier_bytes // fp16,
        },
        "kv_sizes": {
            "vllm": f"--kv-cache-memory-bytes {kv_bytes} (fp32 KV, {fp32} B/token: {kv_bytes // fp32} "
            f"tokens, paged, shared prefixes stored once)",
            "kvfuse": f"engine.kv_memory_bytes {kv_bytes - tier_bytes} (live, fp16 KV, {fp16} B/token: "
            f"{(kv_bytes - tier_bytes) // fp16} tokens, one cache per running sequence) + "
            f"cache.memory_bytes {tier_bytes} (memory tier: {tier_bytes // fp16} tokens) + "
            f"the disk tier (a temp folder)",
        },
        "ttft": "client-side: request sent -> first streamed content token",
        "request": "streamed chat completion with the whole history; prompt_cache_key per user, cache_salt per run; "
        "kvfuse cache off: cache: false",
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["bench/multiround.py", *(argv if argv is not None else sys.argv[1:])]),
        "failures": [],
    }
    points: list[dict] = []
    outputs: dict[str, dict[str, str]] = {}
    t_start = time.perf_counter()
    print(
        f"workload: users {users} x {rounds} rounds, {answer}-token answers, think ~Exp({think:g} s), "
        f"system prompt {args.system_words} words; bound p95 TTFT <= {args.bound:g} s; KV RAM {args.kv_mib:g} MiB "
        f"each",
        file=sys.stderr,
    )

    def save() -> None:
        meta["total_s"] = round(time.perf_counter() - t_start, 1)
        series = {
            s: [p for p in points if p["series"] == s]
            for s in SERIES
            if any(p["series"] == s for p in points)
        }
        result = {
            "meta": meta,
            "points": points,
            "comparison": comparison(series, args.bound),
            "agreement": agreement(points, outputs),
            "outputs": outputs,
        }
        write_json(name, result)

    def record(point: Point, texts: dict[str, str]) -> None:
        d = asdict(point)
        points.append(d)
        outputs[f"{point.series}|{point.users}"] = texts
        split = d["metrics"].get("split", {})
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
        save()

    for server in servers:
        try:
            if server == "kvfuse":
                run_kvfuse(
                    args, workloads, modes, kv_bytes, tier_bytes, ignore_eos, name, meta, record
                )
            else:
                run_vllm(args, workloads, kv_bytes, ignore_eos, name, meta, record)
        except Exception as e:  # keep what the other server measured
            meta["failures"].append(f"{server}: {type(e).__name__}: {e}"[:2000])
            print(f"{server} failed: {e}", file=sys.stderr)
        save()

    series = {
        s: [p for p in points if p["series"] == s]
        for s in SERIES
        if any(p["series"] == s for p in points)
    }
    cmp_ = comparison(series, args.bound)
    print_results(points, cmp_, agreement(points, outputs), meta)
    plot(
        series,
        cmp_,
        plot_path(name),
        f"{args.model}, {rounds} rounds per user, {answer}-token answers, "
        f"KV RAM {args.kv_mib:g} MiB per server ({os.cpu_count()} CPU cores)",
    )
    print(
        f"wrote docs/bench/{name}.json and {name}.png ({time.perf_counter() - t_start:.0f} s)",
        file=sys.stderr,
    )
    return 1 if meta["failures"] else 0


def replot(name: str) -> int:
    """Tables and plot again from ``docs/bench/<name>.json``; derived fields recomputed from the measurements."""
    path = plot_path(name).with_suffix(".json")
    data = json.loads(path.read_text())
    meta, points, outputs = data["meta"], data["points"], data["outputs"]
    for p in points:
        p["cut"] = p["requests"] + p["errors"] < p["planned"]
    series = {
        s: [p for p in points if p["series"] == s]
        for s in SERIES
        if any(p["series"] == s for p in points)
    }
    cmp_ = comparison(series, meta["bound_s"])
    agree = agreement(points, outputs)
    meta["replotted"] = _dt.datetime.now().isoformat(timespec="seconds")
    path.write_text(
        json.dumps(
            {**data, "meta": meta, "points": points, "comparison": cmp_, "agreement": agree},
            indent=2,
        )
    )
    print_results(points, cmp_, agree, meta)
    plot(
        series,
        cmp_,
        plot_path(name),
        f"{meta['model']}, {meta['rounds']} rounds per user, {meta['answer_tokens']}"
        f"-token answers, KV RAM {meta['kv_ram_bytes'] / 2**20:g} MiB per server ({os.cpu_count()} CPU cores)",
    )
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_kvfuse(
    args,
    workloads: dict[int, Workload],
    modes: list[bool],
    kv_bytes: int,
    tier_bytes: int,
    ignore_eos: bool,
    name: str,
    meta: dict,
    record,
) -> None:
    import yaml
    from serve import warm_up

    from kvfuse_testkit import ServerProcess, ensure_model

    ensure_model(args.home, args.model)
    tmp = tempfile.TemporaryDirectory(prefix="kvfuse-bench-multiround-")
    config = {
        "model": args.model,
        "cache": {
            "disk": True,
            "disk_path": str(Path(tmp.name) / "kv"),
            "memory_bytes": tier_bytes,
            "eviction": "queue",
            "prefetch": True,
            "history": True,
        },
        "engine": {"kv_memory_bytes": kv_bytes - tier_bytes},
        "server": {"max_queue": 256, "max_tokens_limit": 1024},
    }
    if args.kvfuse_config:
        config = deep_merge(config, yaml.safe_load(args.kvfuse_config.read_text()) or {})
    extra_args = [a for s in args.kvfuse_arg for a in shlex.split(s)]
    meta["kvfuse_config"], meta["kvfuse_args"] = config, extra_args
    log = args.log_dir / f"{name}-kvfuse.log"
    t0 = time.perf_counter()
    try:
        with ServerProcess(args.home, config=config, args=extra_args, log_path=log) as srv:
            meta["kvfuse_startup_s"] = round(time.perf_counter() - t0, 1)
            print(
                f"kvfuse serve up in {meta['kvfuse_startup_s']} s (pid {srv.pid}, log {log})",
                file=sys.stderr,
            )
            driver = Driver(srv.base_url, args.model, ignore_eos)
            warm_up(driver.runner, max(workloads))
            failed = {c: False for c in modes}
            for i, (u, wl) in enumerate(sorted(workloads.items())):
                order = modes if i % 2 == 0 else modes[::-1]  # alternate which mode runs first
                for cache in order:
                    if failed[cache]:
                        continue
                    series = "kvfuse-on" if cache else "kvfuse-off"
                    salt = f"multiround-{series}-{u}-{time.time_ns()}"
                    warm_s = driver.warm(wl, salt) if cache else None
                    before = kvfuse_metrics(srv.url)
                    point, texts = driver.run(
                        wl,
                        series,
                        cache,
                        salt,
                        args.bound,
                        args.stop_early and i > 0,
                        args.max_point_s,
                    )
                    m = delta(kvfuse_metrics(srv.url), before)
                    point.metrics = {"kvfuse": m, "split": time_split(m, point.requests)}
                    point.warm_s = _r(warm_s, 1)
                    record(point, texts)
                    failed[cache] = not passes(asdict(point), args.bound)
    finally:
        tmp.cleanup()


def run_vllm(
    args,
    workloads: dict[int, Workload],
    kv_bytes: int,
    ignore_eos: bool,
    name: str,
    meta: dict,
    record,
) -> None:
    from serve import warm_up
    from vllm_server import DEFAULT_PYTHON, VLLMServer, default_model_path, tuned_env

    model_path = args.vllm_model_path or default_model_path(args.home, args.model)
    extra_args = [
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        *(a for s in args.vllm_arg for a in shlex.split(s)),
    ]
    env = {
        **(tuned_env(args.vllm_python or DEFAULT_PYTHON) if args.vllm_setup == "tuned" else {}),
        **dict(kv.split("=", 1) for kv in args.vllm_env),
    }
    log = args.log_dir / f"{name}-vllm.log"
    srv = VLLMServer(
        model_path,
        args.model,
        python=args.vllm_python or DEFAULT_PYTHON,
        extra_args=extra_args,
        env=env,
        log_path=log,
    )
    if "VLLM_CPU_KVCACHE_SPACE" not in env:  # (whole GiB) it would override --kv-cache-memory-bytes
        srv.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    meta["vllm_command"] = " ".join(srv.cmd)
    meta["vllm_env"] = env
    print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
    with srv:
        meta["vllm_startup_s"] = round(srv.startup_s, 1)
        tail = srv.log_tail(2_000_000).splitlines()
        meta["vllm_kv_cache"] = [
            ln.split("]", 1)[-1].strip()[:300]
            for ln in tail
            if "KV cache size" in ln or "for KV cache" in ln or "num_gpu_blocks" in ln
        ]
        meta["vllm_cpu_binding"] = [
            ln.split("]", 1)[-1].strip()[:300]
            for ln in tail
            if "core ids=" in ln or "reserved_cpus=" in ln or "Torch threads" in ln
        ]
        meta["vllm_prefix_caching"] = srv.log_has("'enable_prefix_caching': True") or srv.log_has(
            "enable_prefix_caching=True"
        )
        accepts = server_accepts(srv.url, "ignore_eos")
        meta["vllm_accepts_ignore_eos"] = accepts
        if ignore_eos and accepts is False:
            raise RuntimeError("vLLM's schema has no ignore_eos; rerun with --ignore-eos off")
        print(f"vLLM up in {srv.startup_s:.0f} s (pid {srv.proc.pid})", file=sys.stderr)
        driver = Driver(srv.base_url, args.model, ignore_eos)
        warm_up(driver.runner, max(workloads))
        for i, (u, wl) in enumerate(sorted(workloads.items())):
            salt = f"multiround-vllm-{u}-{time.time_ns()}"
            warm_s = driver.warm(wl, salt)
            before = vllm_metrics(srv.url)
            point, texts = driver.run(
                wl, "vllm", True, salt, args.bound, args.stop_early and i > 0, args.max_point_s
            )
            point.metrics = {"vllm": delta(vllm_metrics(srv.url), before)}
            point.warm_s = _r(warm_s, 1)
            record(point, texts)
            if not passes(asdict(point), args.bound):
                break


def agreement(points: list[dict], outputs: dict[str, dict[str, str]]) -> list[dict]:
    """Answers identical to kvfuse cache off's at the same load, per series and load."""
    out = []
    for p in points:
        if p["series"] == "kvfuse-off":
            continue
        ref = outputs.get(f"kvfuse-off|{p['users']}")
        mine = outputs.get(f"{p['series']}|{p['users']}")
        if ref is None or mine is None:
            continue
        first = {k: v for k, v in mine.items() if k.endswith("/r1")}
        out.append(
            {
                "series": p["series"],
                "users": p["users"],
                "vs": "kvfuse-off",
                "same_answers": same_answers(mine, ref),
                "same_round1": same_answers(first, ref),
            }
        )
    vllm = {p["users"] for p in points if p["series"] == "vllm"}
    for p in points:
        if p["series"] == "kvfuse-on" and p["users"] in vllm:
            a, b = outputs.get(f"kvfuse-on|{p['users']}"), outputs.get(f"vllm|{p['users']}")
            if a and b:
                out.append(
                    {
                        "series": "kvfuse-on",
                        "users": p["users"],
                        "vs": "vllm",
                        "same_answers": same_answers(a, b),
                        "same_round1": same_answers(
                            {k: v for k, v in a.items() if k.endswith("/r1")}, b
                        ),
                    }
                )
    return out


def unique_history(p: dict, system_tokens: int) -> int:
    """All users' chats at the end of a run, the shared system prompt counted once."""
    return max(0, p["history_tokens_end"] - (p["users"] - 1) * system_tokens)


def print_results(points: list[dict], cmp_: dict, agree: list[dict], meta: dict) -> None:
    rows = []
    kv = meta["kv_tokens"]
    for p in points:
        hist = unique_history(p, meta["system_tokens"])
        rows.append(
            [
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
                "pass" if passes(p, cmp_["bound_s"]) else "FAIL",
            ]
        )
    print()
    print_table(
        [
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
            f"p95<={cmp_['bound_s']:g}s",
        ],
        rows,
    )
    print(
        f"KV RAM {meta['kv_ram_bytes'] / 2**20:g} MiB each: vLLM {kv['vllm']} tokens (fp32); kvfuse "
        f"{kv['kvfuse_live']} live + {kv['kvfuse_memory_tier']} in the memory tier (fp16), then disk. History: "
        f"every user's chat at the end of the run, the {meta['system_tokens']}-token system prompt counted once."
    )
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
    if "reference_load" in cmp_:
        print(f"p95 TTFT at {cmp_['reference']} ({cmp_['reference_load']}):")
        for s, v in cmp_["p95_at_reference_s"].items():
            print(f"  {LABELS[s]:<34} {_s(v)} s")
        if "vllm_over_kvfuse_p95" in cmp_:
            t = cmp_["target"]
            print(
                f"  vLLM / kvfuse = {cmp_['vllm_over_kvfuse_p95']}x; target (kvfuse serves more: "
                f"{t['kvfuse_serves_more']}, p95 >= 3x lower: {t['p95_3x_lower']}): {'MET' if t['met'] else 'not met'}"
            )
    split_rows = [
        [
            p["users"],
            *p["metrics"]["split"].values(),
            " ".join(
                f"{k[len('reused_chunks_') :]}:{int(v)}"
                for k, v in p["metrics"]["kvfuse"].items()
                if k.startswith("reused_chunks_") and v
            )
            or "-",
            f"{int(p['metrics']['kvfuse'].get('prefetch_hits', 0))}/"
            f"{int(p['metrics']['kvfuse'].get('prefetch_misses', 0))}",
            int(p["metrics"]["kvfuse"].get("preemptions", 0)),
            int(p["metrics"]["kvfuse"].get("memory_evictions", 0)),
        ]
        for p in points
        if p["series"] == "kvfuse-on" and p["metrics"].get("split")
    ]
    if split_rows:
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
            split_rows,
        )
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


def plot(series: dict[str, list[dict]], cmp_: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    styles = {
        "kvfuse-on": ("-o", "tab:blue"),
        "kvfuse-off": ("--s", "tab:cyan"),
        "vllm": ("-^", "tab:red"),
    }
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for s, pts in series.items():
        pts = sorted(pts, key=lambda p: p["load"])
        style, color = styles[s]
        xs = [p["load"] for p in pts if p["ttft_p95_s"] is not None]
        a.plot(
            xs,
            [p["ttft_p95_s"] for p in pts if p["ttft_p95_s"] is not None],
            style,
            color=color,
            label=LABELS[s],
        )
        a.plot(
            [p["load"] for p in pts if p["ttft_p50_s"] is not None],
            [p["ttft_p50_s"] for p in pts if p["ttft_p50_s"] is not None],
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
