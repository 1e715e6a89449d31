"""LMCache's multi-round QA benchmark (vLLM production-stack's ``multi-round-qa.py``), its script
run unchanged but for ``ignore_eos`` against kvfuse, vLLM CPU and llama.cpp's ``llama-server``.

What issue 48 measures from outside: ``--users`` users (6), each with a shared system prompt of
``--system-prompt`` tokens (1,000) and a context of its own of ``--user-context`` tokens (2,000),
asking ``--rounds`` questions (6) of ``--answer-len``-token answers (64), at ``--qps`` requests
per second overall (0.2), for ``--time`` seconds (300). The script is vendored in
``bench/vendor/production_stack/`` (its README says from which commit and what differs) and runs
in its own venv (``bash bench/setup_lmcache_qa.sh``: openai, pandas, tqdm). It writes one row per
request (TTFT, the round as ``question_id``, ...); from those this wrapper reports each server's
TTFT mean, p50 and p95, the first round's mean and the later rounds' mean.

Servers, one at a time, each fresh, on the same model and all cores:

- ``kvfuse``: ``kvfuse serve`` with its defaults (``--kvfuse-weights``, default ``auto``: the
  built-in's own GGUF blocks), its disk tier in a temporary folder;
- ``vllm``: vLLM CPU on the model's HF folder, prefix caching on, tuned per its CPU guide
  (``bench/lib/vllm.py``; ``bash bench/setup_vllm.sh``);
- ``llama.cpp``: ``llama-server`` on ``--llama-gguf`` (default ``own``: the model's shipped file),
  one slot per user of 4,096 tokens, its prompt cache on (``bash bench/setup_llama_server.sh``).

With ``--repeats`` above 1 the servers run again in rotated order and each figure is the median
over repeats (min-max beside). The "met" of issue 48's targets is computed from this run's JSON:
kvfuse's TTFT mean and p95 at most 0.5x vLLM's and 0.25x llama-server's, its first round and its
later rounds at most vLLM's. JSON and PNG: ``docs/bench/lmcache_qa.*``.

    python bench/lmcache_qa.py                          # the issue's settings, 300 s per server
    python bench/lmcache_qa.py --quick                  # smoke: 2 users, 2 rounds, 40 s
"""

from __future__ import annotations

import csv as csvlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import servers as srvs
from bench.lib.cli import add_common, csv
from bench.lib.results import output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import spread

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "vendor" / "production_stack" / "multi-round-qa.py"
QA_PYTHON = ROOT / ".baselines" / "qa-venv" / "bin" / "python"
LLAMA_SLOT_TOKENS = 4096
FIGURES = ("mean", "p50", "p95", "first_round", "later_rounds")
LABELS = {"kvfuse": "kvfuse", "vllm": "vLLM CPU", "llama.cpp": "llama-server"}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_figures(rows: list[dict]) -> dict:
    """The script's request rows (``ttft``, ``question_id``; rows without a first token, whose
    ``generation_tokens`` is 0, are left out and counted) as TTFT figures in seconds."""
    done = [r for r in rows if float(r["generation_tokens"]) > 0]
    ttft = [float(r["ttft"]) for r in done]
    first = [float(r["ttft"]) for r in done if int(r["question_id"]) == 1]
    later = [float(r["ttft"]) for r in done if int(r["question_id"]) > 1]
    return {
        "requests": len(done),
        "without_tokens": len(rows) - len(done),
        "mean": statistics.fmean(ttft) if ttft else None,
        "p50": quantile(ttft, 0.5) if ttft else None,
        "p95": quantile(ttft, 0.95) if ttft else None,
        "first_round": statistics.fmean(first) if first else None,
        "later_rounds": statistics.fmean(later) if later else None,
    }


def met(rows: dict) -> dict:
    """Issue 48's targets from the medians: kvfuse's mean and p95 <= 0.5x vLLM's and <= 0.25x
    llama-server's; its first round and later rounds <= vLLM's. A target whose peer did not run is
    left out."""
    k = rows.get("kvfuse")
    if k is None:
        return {}
    out = {}
    for peer, factor in (("vllm", 0.5), ("llama.cpp", 0.25)):
        p = rows.get(peer)
        if p is None:
            continue
        for f in ("mean", "p95"):
            out[f"{f}_vs_{peer}"] = k[f]["median_s"] <= factor * p[f]["median_s"]
    if "vllm" in rows:
        for f in ("first_round", "later_rounds"):
            out[f"{f}_vs_vllm"] = k[f]["median_s"] <= rows["vllm"][f]["median_s"]
    return out


def run_script(args, base_url: str, out_csv: Path, log: Path) -> list[dict]:
    """The vendored script against ``base_url`` (``.../v1``); its request rows."""
    cmd = [
        str(args.qa_python),
        str(SCRIPT),
        *("--num-users", str(args.users), "--num-rounds", str(args.rounds)),
        *("--shared-system-prompt", str(args.system_prompt)),
        *("--user-history-prompt", str(args.user_context)),
        *("--answer-len", str(args.answer_len), "--qps", str(args.qps)),
        *("--model", args.model, "--base-url", base_url, "--time", str(args.time)),
        *("--output", str(out_csv), "--log-interval", str(max(30, args.time))),
    ]
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=SCRIPT.parent, stdout=f, stderr=subprocess.STDOUT, check=True)
    with open(out_csv, newline="") as f:
        return list(csvlib.DictReader(f))


def start(args, name: str, stack, tmp: Path):
    log = srvs.log_path(args, "lmcache_qa", name)
    if name == "kvfuse":
        config = {
            "model": args.model,
            "weights": args.kvfuse_weights,
            "cache": {"disk_path": str(tmp / "kv")},
        }
        srv = stack.enter_context(srvs.kvfuse_process(args, config, log, {}))
        return srv, srv.base_url
    if name == "vllm":
        srv, _env = srvs.vllm_process(args, ["--max-model-len", "8192"], log, 4)
        print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
        stack.enter_context(srv)
        return srv, srv.base_url
    srv = srvs.llama_process(args, args.users * LLAMA_SLOT_TOKENS, args.users, log)
    stack.enter_context(srv)
    return srv, srv.url + "/v1"


def measure(args, name: str, repeat: int) -> dict:
    import contextlib

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfuse-qa-")))
        t0 = time.perf_counter()
        _srv, base = start(args, name, stack, tmp)
        up_s = time.perf_counter() - t0
        rows = run_script(
            args, base, tmp / "summary.csv", srvs.log_path(args, "lmcache_qa", f"{name}-script")
        )
    out = ttft_figures(rows)
    out["startup_s"] = round(up_s, 1)
    shown = ", ".join(f"{f} {out[f]:.3f}" for f in FIGURES if out[f] is not None)
    print(
        f"  repeat {repeat} {name:<9} TTFT s: {shown} ({out['requests']} requests)", file=sys.stderr
    )
    return out


def summarize(samples: dict[str, list[dict]]) -> dict:
    rows = {}
    for name, runs in samples.items():
        row = {
            f: spread([r[f] for r in runs if r[f] is not None], "_s")
            for f in FIGURES
            if any(r[f] is not None for r in runs)
        }
        row["requests"] = [r["requests"] for r in runs]
        rows[name] = row
    return rows


def plot(rows: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(rows))
    for i, (name, row) in enumerate(rows.items()):
        figs = [f for f in FIGURES if f in row]
        xs = [FIGURES.index(f) + i * width for f in figs]
        ax.bar(xs, [row[f]["median_s"] for f in figs], width, label=LABELS[name])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(FIGURES))], FIGURES)
    ax.set_yscale("log")  # llama-server's queue can be 100x the others
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title("LMCache multi-round QA (production-stack script)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)


def parse():
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    srvs.add_server_flags(p, "lmcache_qa", default="kvfuse,vllm,llama.cpp")
    p.set_defaults(llama_gguf="own")
    add_common(p, "quick", "tag")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--rounds", type=int, default=6, help="questions per user")
    p.add_argument("--system-prompt", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--user-context", type=int, default=2000, help="each user's own context")
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--qps", type=float, default=0.2)
    p.add_argument("--time", type=int, default=300, help="seconds per server")
    p.add_argument("--repeats", type=int, default=1, help="runs per server, in rotated order")
    p.add_argument("--kvfuse-weights", default="auto", help="kvfuse's weights: auto | fp32 | int8")
    p.add_argument("--qa-python", type=Path, default=QA_PYTHON, help="the script's venv python")
    args = p.parse_args()
    if args.quick:
        args.users, args.rounds, args.time = 2, 2, 40
        args.system_prompt, args.user_context, args.qps = 200, 300, 0.5
    names = csv(args.servers)
    for n in names:
        if n not in srvs.ENGINES:
            p.error(f"unknown server {n!r}: choose from {', '.join(srvs.ENGINES)}")
    if not args.qa_python.exists():
        p.error(f"{args.qa_python} is missing: run bash bench/setup_lmcache_qa.sh")
    return args, names


def main() -> None:
    args, names = parse()
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            samples[n].append(measure(args, n, r))
    rows = summarize(samples)
    result = {
        "model": args.model,
        "settings": {
            k: getattr(args, k)
            for k in (
                "users",
                "rounds",
                "system_prompt",
                "user_context",
                "answer_len",
                "qps",
                "time",
                "repeats",
                "kvfuse_weights",
                "llama_gguf",
                "vllm_setup",
            )
        },
        "script": "vllm-project/production-stack@a6c01db benchmarks/multi-round-qa (ignore_eos)",
        "servers": rows,
        "targets": {"vs_vllm": 0.5, "vs_llama.cpp": 0.25, "rounds_vs_vllm": 1.0},
        "met": met(rows),
        "samples": samples,
    }
    name = output_name("lmcache_qa", args.tag, args.quick)
    print_table(
        ["server", *[f"{f} s" for f in FIGURES]],
        [
            [LABELS[n], *[round(r[f]["median_s"], 3) if f in r else "-" for f in FIGURES]]
            for n, r in rows.items()
        ],
    )
    print("met:", result["met"])
    print("wrote", write_json(name, result))
    plot(rows, name)


if __name__ == "__main__":
    main()
