"""Multi-turn conversations (CachedAttention): TTFT turn by turn, history reuse, placement under a
memory budget, save cost, and the quality cost of reusing KV after dropped turns.

Part ``replay`` (default). Real conversations from ``../shared/data/sharegpt_multiturn_dev.jsonl``
(all of it is dev data; the file has no test split): the ``--conversations`` conversations with
at least ``--turns`` user turns, their user turns replayed in order, each answered by the model
itself (greedy, ``--max-tokens``), so the history a turn re-sends is the model's own (its KV can
be kept). All conversations run at once, with think time between a conversation's turns, through
one in-process engine with its loop thread (the server's engine, without HTTP). The memory tier
gets ``--budget`` (default 25%) of the working set: the KV of every conversation's final history.
Four set-ups, interleaved ``--repeats`` times (the order rotates), each starting cold:

- ``no-reuse``: the KV cache off: every turn prefills its whole prompt;
- ``prefix-lru``: whole 256-token chunks of the prompt only, memory tier only, LRU (what a prefix
  cache such as vLLM's or SGLang's keeps);
- ``history-disk``: kvfuse's whole-history reuse (the prompt, the answer, the partial last chunk),
  memory + disk tier, LRU, no prefetch;
- ``history-prefetch``: the same with queue-aware placement: the KV of queued turns is prefetched
  from disk into memory and not evicted while they wait.

Reported per set-up: TTFT per turn (p50/p95; the engine's time from admission to the first token,
and that plus queueing), the share of each turn's history reused (previous prompt + previous
answer), hit rate by tier, prefetch hits/misses, prefill tokens saved, throughput, the share of
request time spent saving on the request path (and the saver thread's own time), and whether the
answers equal the no-reuse run's token for token.

Part ``truncation``. Conversations whose history (recorded answers) outgrows a context window of
``--context`` tokens: the turn that no longer fits drops its oldest turns (keeping the system
prompt). Reuse (the kept turns' stored KV at new positions, keys re-rotated) against recompute
(the truncated prompt prefilled): KL divergence of next-token distributions over the recorded
next answer (teacher-forced), greedy agreement of the next ``--max-tokens`` tokens, reused tokens
and TTFT.

Results: ``docs/bench/multiturn.json`` + ``multiturn.png`` and ``multiturn_truncation.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from bench.lib.cli import add_common
from bench.lib.client import concurrently
from bench.lib.paths import DATA
from bench.lib.results import print_table, pyplot, save_figure, stem, write_json
from bench.lib.rounds import interleaved
from kvfuse.config import load_config
from kvfuse.generation import SamplingParams
from kvfuse.prompts import PromptBuilder
from kvfuse.runtime import open_engine, open_model, open_serving

SETUPS = {
    "no-reuse": {"cache.enabled": False},
    "prefix-lru": {
        "cache.history": False,
        "cache.disk": False,
        "cache.eviction": "lru",
        "cache.prefetch": False,
    },
    "history-disk": {"cache.history": True, "cache.eviction": "lru", "cache.prefetch": False},
    "history-prefetch": {"cache.history": True, "cache.eviction": "queue", "cache.prefetch": True},
    # not in the default comparison: saving on the request path, to measure what the saver thread costs
    "history-sync-save": {
        "cache.history": True,
        "cache.eviction": "queue",
        "cache.prefetch": True,
        "cache.async_save": False,
    },
}
DEFAULT_SETUPS = ["no-reuse", "prefix-lru", "history-disk", "history-prefetch"]
SYSTEM = "You are a helpful assistant."


def conversations(n: int, min_turns: int, max_chars: int) -> list[list[str]]:
    """The user turns of the first ``n`` conversations with at least ``min_turns`` of them (each
    cut to ``max_chars`` characters)."""
    out = []
    for line in (DATA / "sharegpt_multiturn_dev.jsonl").read_text().splitlines():
        conv = json.loads(line)
        users = [m["content"][:max_chars] for m in conv["messages"] if m["role"] == "user"]
        if len(users) >= min_turns:
            out.append(users[:min_turns])
        if len(out) == n:
            break
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def kv_bytes_per_token(model) -> int:
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # fp16 KV


def working_set_tokens(model, convs: list[list[str]], max_tokens: int) -> int:
    """Tokens of every conversation's final history, answers counted at ``max_tokens`` each."""
    tok, total = model.tokenizer, 0
    for users in convs:
        msgs = [{"role": "system", "content": SYSTEM}]
        for u in users:
            msgs += [
                {"role": "user", "content": u},
                {"role": "assistant", "content": "x " * max_tokens},
            ]
        total += len(tok.encode_chat(msgs, add_generation_prompt=False))
    return total


def replay(setup: str, model, convs, args, budget: int, workdir: Path, seed: int) -> dict:
    """One cold run of every conversation at once under ``setup``."""
    overrides = {
        "model": args.model,
        "home": args.home,
        "cache.memory_bytes": budget,
        "cache.disk_path": str(workdir / f"{setup}-{seed}"),
        "server.max_queue": 256,
        **SETUPS[setup],
    }
    serving = open_serving(
        load_config(overrides={k: v for k, v in overrides.items() if v is not None}), model=model
    )
    engine, prompts = serving.engine, serving.prompts
    engine.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    turns: list[dict] = []
    lock = threading.Lock()

    def client(ci: int, users: list[str]) -> None:
        rng = random.Random(seed * 1000 + ci)
        time.sleep(ci * args.stagger)
        msgs = [{"role": "system", "content": SYSTEM}]
        prev = None
        for ti, user in enumerate(users):
            msgs.append({"role": "user", "content": user})
            ids, dropped = prompts.encode_chat(msgs, reserve=args.max_tokens)
            r = engine.generate(ids, params)
            with lock:
                turns.append(turn_row(ci, ti, r, prev, dropped))
            msgs.append({"role": "assistant", "content": r.text})
            prev = r
            time.sleep(rng.uniform(*args.think))

    wall = concurrently(client, convs)
    return {"setup": setup, "seed": seed, "wall_s": wall, "turns": turns, **engine_report(engine)}


def turn_row(ci: int, ti: int, r, prev, dropped) -> dict:
    return {
        "conversation": ci,
        "turn": ti + 1,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "tokens": r.token_ids,
        "ttft_s": r.timings.ttft_s,
        "queued_s": r.timings.queued_s,
        "total_s": r.timings.total_s,
        "store_s": r.timings.store_s,
        "lookup_s": r.timings.lookup_s,
        "load_s": r.timings.load_s,
        "prefill_s": r.timings.prefill_s,
        "hit_tiers": list(r.hit_tiers),
        "dropped_messages": dropped,
        # the KV the previous turn left: its prompt and the answer tokens fed back
        "history_tokens": 0
        if prev is None
        else prev.prompt_tokens + max(0, prev.completion_tokens - 1),
    }


def engine_report(engine) -> dict:
    """The engine's counters after its saves are flushed; the engine closed."""
    engine.flush(60)
    stats, cache = engine.stats_snapshot(), engine.cache_stats()
    saver = stats.get("saver", {})
    engine.close()
    return {
        "engine": stats,
        "store": cache.get("store", {}),
        "tiers": {k: v for k, v in cache.items() if k != "store"},
        "saver": saver,
    }


def summarize(runs: list[dict], reference: dict[tuple, list[int]]) -> dict:
    turns = [t for r in runs for t in r["turns"]]
    by_turn: dict[int, list[dict]] = {}
    for t in turns:
        by_turn.setdefault(t["turn"], []).append(t)
    hist = [t for t in turns if t["history_tokens"]]
    hits: dict[str, int] = {}
    for r in runs:
        for tier, n in r["engine"]["hits_by_tier"].items():
            hits[tier] = hits.get(tier, 0) + n
    same = sum(
        reference.get((r["seed"], t["conversation"], t["turn"])) == t["tokens"]
        for r in runs
        for t in r["turns"]
    )
    prompt = sum(t["prompt_tokens"] for t in turns)
    return {
        "turns": len(turns),
        "ttft_by_turn": {
            k: {
                "p50": pct([t["ttft_s"] for t in v], 0.5),
                "p95": pct([t["ttft_s"] for t in v], 0.95),
                "p50_with_queue": pct([t["ttft_s"] + t["queued_s"] for t in v], 0.5),
                "p95_with_queue": pct([t["ttft_s"] + t["queued_s"] for t in v], 0.95),
                "prompt_tokens": statistics.mean(t["prompt_tokens"] for t in v),
            }
            for k, v in sorted(by_turn.items())
        },
        "ttft_p50_turn8plus": pct([t["ttft_s"] for t in turns if t["turn"] >= 8], 0.5),
        "breakdown_turn8plus": {
            k: pct([t[k] for t in turns if t["turn"] >= 8], 0.5)
            for k in ("lookup_s", "load_s", "prefill_s", "queued_s")
        },
        "ttft_p50_turn8plus_with_queue": pct(
            [t["ttft_s"] + t["queued_s"] for t in turns if t["turn"] >= 8], 0.5
        ),
        "history_reused": (
            sum(min(t["cached_tokens"], t["history_tokens"]) for t in hist)
            / max(1, sum(t["history_tokens"] for t in hist))
        ),
        "prefill_tokens_saved": sum(t["cached_tokens"] for t in turns) / max(1, prompt),
        "hits_by_tier": hits,
        "prefetched": sum(r["store"].get("prefetched", 0) for r in runs),
        "prefetch_hits": sum(r["store"].get("prefetch_hits", 0) for r in runs),
        "prefetch_misses": sum(r["store"].get("prefetch_misses", 0) for r in runs),
        "memory_evictions": sum(r["tiers"].get("memory", {}).get("evictions", 0) for r in runs),
        "protected_evictions": sum(
            r["tiers"].get("memory", {}).get("protected_evictions", 0) for r in runs
        ),
        "turns_per_s": [len(r["turns"]) / r["wall_s"] for r in runs],
        "save_share_request_path": sum(t["store_s"] for t in turns)
        / max(1e-9, sum(t["total_s"] for t in turns)),
        "saver_thread_s": sum(r["saver"].get("save_s", 0.0) for r in runs),
        "save_waits": sum(r["saver"].get("save_waits", 0) for r in runs),
        "answers_equal_to_no_reuse": f"{same}/{len(turns)}",
    }


def run_replay(args) -> None:
    model = open_model(load_config(overrides={"model": args.model, "home": args.home}))
    convs = conversations(args.conversations, args.turns, args.max_chars)
    ws_tokens = working_set_tokens(model, convs, args.max_tokens)
    ws = ws_tokens * kv_bytes_per_token(model)
    budget = int(ws * args.budget)
    print(
        f"{len(convs)} conversations x {args.turns} turns (sharegpt_multiturn_dev.jsonl, dev data); working set "
        f"{ws_tokens} tokens = {ws / 2**20:.0f} MiB of KV; memory budget {budget / 2**20:.0f} MiB ({args.budget:.0%})"
    )
    order = list(args.setups)
    with tempfile.TemporaryDirectory(prefix="kvfuse-multiturn-") as tmp:

        def one(setup: str):
            def run(rep: int) -> dict:
                t0 = time.perf_counter()
                out = replay(setup, model, convs, args, budget, Path(tmp), seed=rep)
                print(f"  repeat {rep + 1} {setup}: {time.perf_counter() - t0:.0f} s", flush=True)
                return out

            return run

        # rotate: no set-up always first
        runs = interleaved({s: one(s) for s in order}, args.repeats, rotate=True)
    reference = {
        (r["seed"], t["conversation"], t["turn"]): t["tokens"]
        for r in runs.get("no-reuse", [])
        for t in r["turns"]
    }
    summary = {s: summarize(rs, reference) for s, rs in runs.items()}
    print_replay(summary, order)
    name = args.name
    write_json(
        name,
        {
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "working_set_tokens": ws_tokens,
            "memory_budget_bytes": budget,
            "summary": summary,
            "runs": {s: [without_tokens(r) for r in rs] for s, rs in runs.items()},
        },
    )
    plot(summary, name)
    print(f"\nwrote {stem(name)}.json and {name}.png")


def without_tokens(run: dict) -> dict:
    return {**run, "turns": [{k: v for k, v in t.items() if k != "tokens"} for t in run["turns"]]}


REPLAY_HEADERS = [
    "setup",
    "TTFT p50 t>=8 s",
    "x",
    "+queue s",
    "x",
    "history reused",
    "prefill saved",
    "chunk hits",
    "prefetch hit/miss",
    "turns/s med [min,max]",
    "save share",
    "same answers",
]


def replay_row(s: str, v: dict, base: dict | None) -> list:
    """A set-up's row; sets its TTFT ratios against no-reuse in ``v`` too."""
    ratio = base["ttft_p50_turn8plus"] / v["ttft_p50_turn8plus"] if base else float("nan")
    ratio_q = (
        base["ttft_p50_turn8plus_with_queue"] / v["ttft_p50_turn8plus_with_queue"]
        if base
        else float("nan")
    )
    v["ttft_ratio_turn8plus"], v["ttft_ratio_turn8plus_with_queue"] = ratio, ratio_q
    tps = v["turns_per_s"]
    return [
        s,
        v["ttft_p50_turn8plus"],
        ratio,
        v["ttft_p50_turn8plus_with_queue"],
        ratio_q,
        f"{v['history_reused']:.1%}",
        f"{v['prefill_tokens_saved']:.1%}",
        " ".join(f"{k}:{n}" for k, n in sorted(v["hits_by_tier"].items())) or "-",
        f"{v['prefetch_hits']}/{v['prefetch_misses']}",
        f"{statistics.median(tps):.3f} [{min(tps):.3f}, {max(tps):.3f}]",
        f"{v['save_share_request_path']:.2%}",
        v["answers_equal_to_no_reuse"],
    ]


def print_replay(summary: dict, order: list[str]) -> None:
    base = summary.get("no-reuse")
    print()
    print_table(REPLAY_HEADERS, [replay_row(s, v, base) for s, v in summary.items()])
    print()
    print_table(
        ["setup", "turns >= 8 medians: lookup s", "load s", "compute s", "queued s"],
        [[s, *v["breakdown_turn8plus"].values()] for s, v in summary.items()],
    )
    print()
    turns_all = sorted(next(iter(summary.values()))["ttft_by_turn"])
    print_table(
        ["turn", "prompt tokens", *[f"{s} p50/p95" for s in summary]],
        [
            [
                k,
                summary[order[0]]["ttft_by_turn"][k]["prompt_tokens"],
                *[
                    f"{summary[s]['ttft_by_turn'][k]['p50']:.3f}/{summary[s]['ttft_by_turn'][k]['p95']:.3f}"
                    for s in summary
                ],
            ]
            for k in turns_all
        ],
    )


def plot(summary: dict, name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s, v in summary.items():
        ks = sorted(v["ttft_by_turn"])
        a.plot(ks, [v["ttft_by_turn"][k]["p50"] for k in ks], marker="o", label=s)
    a.set_yscale("log")
    a.set_xlabel("turn")
    a.set_ylabel("TTFT p50 (s, log)")
    a.set_title("TTFT per turn (engine: admission to first token)")
    a.legend()
    names = list(summary)
    b.bar(names, [summary[s]["history_reused"] * 100 for s in names])
    b.set_ylabel("% of the previous turns' tokens reused")
    b.set_title("history reuse at the memory budget")
    b.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    save_figure(fig, name)


# ------------------------------------------------------------------------------ truncation


def truncation_engines(args, model) -> dict:
    return {
        mode: open_engine(
            load_config(
                overrides={
                    "model": args.model,
                    "home": args.home,
                    "cache.disk": False,
                    "context_tokens": args.context,
                    "cache.truncation": mode,
                    **({"home": args.home} if args.home else {}),
                }
            ),
            model=model,
        )
        for mode in ("reuse", "recompute")
    }


def truncation_items(args, tok) -> list[tuple]:
    """(the last history that fits, the next one that does not, its recorded answer) of the first
    ``--conversations`` dev conversations that outgrow the context window."""
    items = []
    for line in (DATA / "sharegpt_multiturn_dev.jsonl").read_text().splitlines():
        if len(items) >= args.conversations:
            break
        conv = json.loads(line)["messages"]
        msgs = [{"role": "system", "content": SYSTEM}]
        prev_fit = None
        for i in range(0, len(conv) - 1, 2):
            nxt = msgs + [conv[i]]
            if len(tok.encode_chat(nxt)) + args.max_tokens > args.context:
                if prev_fit is not None and i + 1 < len(conv):
                    items.append((prev_fit, nxt, conv[i + 1]["content"]))
                break
            prev_fit = nxt
            msgs = nxt + [conv[i + 1]]
    return items


def truncated_turn(args, engine, tok, params, before, after, answer) -> dict:
    """One mode: the history that fit cached, then the truncated one answered and scored."""
    engine.clear_cache("")
    prompts = PromptBuilder.for_model(engine.model, engine.context_window)
    prime = prompts.encode_chat(before, reserve=args.max_tokens)[0]
    engine.generate(prime, SamplingParams(max_tokens=1))
    ids, dropped = prompts.encode_chat(after, reserve=args.max_tokens)
    cont = tok.encode(answer, add_special_tokens=False)[: args.score_tokens]
    s0 = engine.stats_snapshot()
    r = engine.generate(ids, params)
    engine.generate(prime, SamplingParams(max_tokens=1))
    logits = engine.score(ids, [cont])[0]
    s1 = engine.stats_snapshot()
    return {
        "ids": r.token_ids,
        "cached": r.cached_tokens,
        "moved": s1["moved_tokens_reused"] - s0["moved_tokens_reused"],
        "ttft_s": r.timings.ttft_s,
        "logits": logits.float(),
        "dropped": dropped,
        "prompt": len(ids),
        "prompt_ids": ids,
    }


def truncation_row(n: int, out: dict) -> dict:
    p = torch.log_softmax(out["recompute"]["logits"], -1)
    q = torch.log_softmax(out["reuse"]["logits"], -1)
    kl = (p.exp() * (p - q)).sum(-1)
    a, b = out["reuse"]["ids"], out["recompute"]["ids"]
    agree = sum(x == y for x, y in zip(a, b)) / max(1, max(len(a), len(b)))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {
        "item": n,
        "prompt_tokens": len(out["recompute"]["prompt_ids"]),
        "dropped_messages": out["reuse"]["dropped"],
        "reused_tokens": out["reuse"]["cached"],
        "moved_tokens": out["reuse"]["moved"],
        "recompute_cached_tokens": out["recompute"]["cached"],
        "kl_mean": float(kl.mean()),
        "kl_first": float(kl[0]),
        "top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
        "greedy_token_agreement": agree,
        "greedy_identical_prefix": prefix,
        "greedy_identical": a == b,
        "ttft_reuse_s": out["reuse"]["ttft_s"],
        "ttft_recompute_s": out["recompute"]["ttft_s"],
    }


def truncation_summary(rows: list[dict]) -> dict:
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "items": len(rows),
        "kl_mean_median": med("kl_mean"),
        "kl_mean_max": max(r["kl_mean"] for r in rows),
        "top1_agree_median": med("top1_agree"),
        "greedy_identical": sum(r["greedy_identical"] for r in rows),
        "greedy_token_agreement_median": med("greedy_token_agreement"),
        "reused_share_median": statistics.median(
            r["reused_tokens"] / r["prompt_tokens"] for r in rows
        ),
        "ttft_reuse_median_s": med("ttft_reuse_s"),
        "ttft_recompute_median_s": med("ttft_recompute_s"),
    }


def print_truncation(summary: dict) -> None:
    print_table(
        ["items", "KL med", "KL max", "top-1 agree", "greedy identical", "token agree"]
        + ["reused share", "TTFT reuse s", "TTFT recompute s"],
        [
            [
                summary["items"],
                summary["kl_mean_median"],
                summary["kl_mean_max"],
                summary["top1_agree_median"],
                f"{summary['greedy_identical']}/{summary['items']}",
                summary["greedy_token_agreement_median"],
                f"{summary['reused_share_median']:.1%}",
                summary["ttft_reuse_median_s"],
                summary["ttft_recompute_median_s"],
            ]
        ],
    )


def run_truncation(args) -> None:
    model = open_model(load_config(overrides={"model": args.model, "home": args.home}))
    tok = model.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engines = truncation_engines(args, model)
    rows = []
    for n, (before, after, answer) in enumerate(truncation_items(args, tok)):
        out = {
            mode: truncated_turn(args, engine, tok, params, before, after, answer)
            for mode, engine in engines.items()
        }
        rows.append(row := truncation_row(n, out))
        print(
            f"  item {n}: prompt {row['prompt_tokens']} reused {row['reused_tokens']} "
            f"(moved {row['moved_tokens']}) KL {row['kl_mean']:.4f} identical {row['greedy_identical']}",
            flush=True,
        )
    for e in engines.values():
        e.close()
    if not rows:
        raise SystemExit("no conversation outgrows the context window; lower --context")
    summary = truncation_summary(rows)
    print_truncation(summary)
    name = args.name + "_truncation"
    write_json(
        name,
        {
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "summary": summary,
            "items": rows,
        },
    )
    print(f"\nwrote {stem(name)}.json")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=["replay", "truncation"], default="replay")
    add_common(ap, "model")
    add_common(ap, "home")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10, help="user turns replayed per conversation")
    ap.add_argument(
        "--max-chars", type=int, default=1500, help="user messages are cut to this many characters"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="answer length cap (greedy); 128: about the recorded answers of these conversations "
        "(mean 124 tokens), so the histories are as long as the real ones",
    )
    ap.add_argument(
        "--think", type=float, nargs=2, default=(0.5, 2.0), help="think time range between turns, s"
    )
    ap.add_argument(
        "--stagger", type=float, default=0.3, help="start of conversation i: i * stagger s"
    )
    ap.add_argument(
        "--budget", type=float, default=0.25, help="memory tier size as a share of the working set"
    )
    add_common(ap, ("repeats", {"default": 2}))
    ap.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS, choices=list(SETUPS))
    ap.add_argument(
        "--context", type=int, default=1024, help="truncation part: the context window, tokens"
    )
    ap.add_argument(
        "--score-tokens", type=int, default=32, help="truncation part: teacher-forced answer tokens"
    )
    ap.add_argument("--name", default="multiturn")
    args = ap.parse_args()
    torch.manual_seed(0)
    (run_truncation if args.part == "truncation" else run_replay)(args)


if __name__ == "__main__":
    main()
