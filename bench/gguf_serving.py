"""A built-in model's own GGUF served by kvfuse and by llama.cpp's ``llama-server``, side by side.

What issue 48 measures from outside: streamed chats of ``--tokens`` tokens (``ignore_eos``) at
1, 8 and 16 concurrent streams, a cold prompt of ``--prefill`` tokens, and each server's resident
memory, all on the very file the model ships as (SmolLM2: Q4_1 with a Q8_0 embedding).

Candidates, all on ``--threads`` CPU threads, started once and measured one at a time (a server
waiting for requests computes nothing), round after round in rotating order:

- ``kvfuse``: ``kvfuse serve`` with ``weights: auto`` (the GGUF's own blocks, kvfuse's kernels);
- ``kvfuse-fp32``: the same with ``weights: fp32`` (the file dequantized to float32: kvfuse
  before the GGUF blocks);
- ``llama.cpp``: ``llama-server`` on the same file (``bench/lib/llama_server.py``), one slot per
  stream, each slot holding ``--prefill`` + ``--tokens`` tokens, its prompt cache on.

Every request is headed by a line naming its candidate, round and stream, so that none finds
another's KV (cold in every engine; kvfuse's disk tier is off). One stream: decode tokens/s,
``(tokens - 1) / (last token - first token)``; 8 and 16 streams: output tokens/s over the wall
time of the batch. Prefill: TTFT of one greedy completion (``max_tokens`` 2) of MuSiQue dev text.
Memory: ``VmRSS`` of the server process and its children right after each round (busy: freed
buffers still kept for reuse) and, for kvfuse, again once it has been idle long enough to give
them back (``engine.release_idle_s``, ``kvfuse.heap``), and the peak (``VmHWM``, start-up
included); max over rounds, each against the target budget ``file size + KV in use + 400 MB``,
where KV in use is ``kvfuse_kv_memory_peak_bytes`` (live KV) plus
``kvfuse_tier_used_bytes{tier="memory"}`` (KV kept in the memory tier) from its ``/metrics``.

Ratios come from the medians of this one run; "met" is computed from them against the issue's
targets: one stream >= 1.0x llama-server, 16 streams >= 1.5x, cold prefill >= 1.0x (TTFT at most
llama-server's), kvfuse's busy and idle RSS within its budget (the peak is reported beside). JSON and PNG: ``docs/bench/gguf_serving.*``.

    python bench/gguf_serving.py                       # smollm2, 3 rounds
    python bench/gguf_serving.py --quick               # smoke: 1 round, 16 tokens, 256-token prompt
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import servers as srvs
from bench.lib.cli import add_common, csv
from bench.lib.client import Runner, concurrently, timed_completion
from bench.lib.data import dev_text_tokens, sharegpt_first_messages
from bench.lib.results import output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, spread
from kvfuse.config.sections import EngineConfig

CANDIDATES = ("kvfuse", "kvfuse-fp32", "llama.cpp")
WEIGHTS = {"kvfuse": "auto", "kvfuse-fp32": "fp32"}
LABELS = {
    "kvfuse": "kvfuse (GGUF blocks)",
    "kvfuse-fp32": "kvfuse (fp32 copy)",
    "llama.cpp": "llama-server",
}
TARGETS = {"streams_1": 1.0, "streams_16": 1.5, "prefill": 1.0}
MB = 1 << 20
IDLE_WAIT_S = EngineConfig().release_idle_s + 2.0  # the release, and the loop's 1 s look


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident bytes of ``pid`` and its descendants (``/proc``; 0 for a process gone); ``field``
    ``VmHWM``: the sum of their peaks."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(
                int(x.split()[1]) for x in status.splitlines() if x.startswith(field + ":")
            )
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total * 1024


def kv_in_use(url: str) -> int:
    """kvfuse's live KV peak plus its memory tier's bytes, from ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    total = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvfuse_kv_memory_peak_bytes" or (
                s.name == "kvfuse_tier_used_bytes" and s.labels.get("tier") == "memory"
            ):
                total += int(s.value)
    return total


def streams(base_url: str, model: str, asks: list[str], head: str, tokens: int) -> dict:
    """``len(asks)`` streamed chats at once; the decode rate of one, or tokens/s of them all."""
    runner = Runner(base_url, model, "bench", ignore_eos=True)
    out: list[dict] = []

    def one(i: int, ask: str) -> None:
        msgs = [{"role": "user", "content": f"{head} stream {i}.\n{ask}"}]
        out.append(runner.stream({"ignore_eos": True}, tokens, messages=msgs))

    wall = concurrently(one, asks)
    made = sum(s["completion_tokens"] for s in out)
    if len(asks) == 1:
        s = out[0]
        return {"tok_s": (made - 1) / (s["latency"] - s["ttft"]), "tokens": made}
    return {"tok_s": made / wall, "tokens": made}


def prefill(base_url: str, model: str, text: str, head: str) -> dict:
    body = {"model": model, "prompt": f"{head}\n{text}", "max_tokens": 2, "temperature": 0}
    first, _last, _text, usage = timed_completion(base_url, body, timeout=1800)
    return {"ttft_s": first, "prompt_tokens": usage.get("prompt_tokens")}


def measure(args, name: str, srv, asks: list[str], text: str, r: int) -> dict:
    base = srv.base_url if name != "llama.cpp" else srv.url + "/v1"
    head = f"Request of {name}, round {r}"
    out = {}
    for c in args.streams:
        out[f"streams_{c}"] = streams(base, args.model, asks[:c], f"{head}, {c}", args.tokens)
    out["prefill"] = prefill(base, args.model, text, f"{head}, prefill.")
    out["rss_bytes"] = rss_bytes(srv.pid)
    if name != "llama.cpp":
        out["kv_bytes"] = kv_in_use(srv.url)
        time.sleep(IDLE_WAIT_S)  # the engine gives freed buffers back once idle
        out["idle_rss_bytes"] = rss_bytes(srv.pid)
    out["peak_rss_bytes"] = rss_bytes(srv.pid, "VmHWM")
    line = ", ".join(f"{c} streams {out[f'streams_{c}']['tok_s']:.1f} tok/s" for c in args.streams)
    print(
        f"  round {r} {name:<11} {line}; prefill {out['prefill']['ttft_s']:.2f} s; "
        f"RSS {out['rss_bytes'] / MB:.0f} MB",
        file=sys.stderr,
    )
    return out


def start(args, name: str, stack, slots: int):
    log = srvs.log_path(args, "gguf_serving", name)
    if name == "llama.cpp":
        srv = srvs.llama_process(args, slots * (args.prefill + args.tokens + 64), slots, log)
        return stack.enter_context(srv)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfuse-gguf-"))
    config = {
        "model": args.model,
        "weights": WEIGHTS[name],
        "threads": args.threads,
        "cache": {"disk": False, "disk_path": f"{tmp}/kv"},
    }
    return stack.enter_context(srvs.kvfuse_process(args, config, log, {}))


def summarize(samples: dict, args, file_bytes: int) -> dict:
    keys = [f"streams_{c}" for c in args.streams]
    rows = {}
    for name, runs in samples.items():
        row = {k: spread([run[k]["tok_s"] for run in runs], "_tok_s") for k in keys}
        row["prefill"] = spread([run["prefill"]["ttft_s"] for run in runs], "_ttft_s")
        row["prompt_tokens"] = runs[0]["prefill"]["prompt_tokens"]
        row["max_rss_bytes"] = max(run["rss_bytes"] for run in runs)
        row["peak_rss_bytes"] = max(run["peak_rss_bytes"] for run in runs)
        if "kv_bytes" in runs[0]:
            row["idle_rss_bytes"] = max(run["idle_rss_bytes"] for run in runs)
            row["kv_bytes"] = max(run["kv_bytes"] for run in runs)
            row["rss_budget_bytes"] = file_bytes + row["kv_bytes"] + 400 * MB
        rows[name] = row
    return rows


def ratios(rows: dict) -> dict:
    """kvfuse over llama-server, from this run's medians: tokens/s ratios, and llama-server's TTFT
    over kvfuse's for the prefill (above 1: kvfuse faster)."""
    if "kvfuse" not in rows or "llama.cpp" not in rows:
        return {}
    kv, ll = rows["kvfuse"], rows["llama.cpp"]
    out = {k: kv[k]["median_tok_s"] / ll[k]["median_tok_s"] for k in kv if k.startswith("streams_")}
    out["prefill"] = ll["prefill"]["median_ttft_s"] / kv["prefill"]["median_ttft_s"]
    return {k: round(v, 3) for k, v in out.items()}


def met(rows: dict, rat: dict) -> dict:
    out = {k: rat[k] >= t for k, t in TARGETS.items() if k in rat}
    if "kvfuse" in rows:
        kv = rows["kvfuse"]
        out["rss"] = kv["max_rss_bytes"] <= kv["rss_budget_bytes"]
        out["rss_idle"] = kv["idle_rss_bytes"] <= kv["rss_budget_bytes"]
    return out


def plot(rows: dict, args, path) -> None:
    plt = pyplot()
    keys = [f"streams_{c}" for c in args.streams]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(rows)
    for i, (name, row) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(keys))]
        med = [row[k]["median_tok_s"] for k in keys]
        err = [
            [m - row[k]["min_tok_s"] for m, k in zip(med, keys)],
            [row[k]["max_tok_s"] - m for m, k in zip(med, keys)],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=LABELS[name])
        p = row["prefill"]
        bx.bar(
            i,
            p["median_ttft_s"],
            yerr=[[p["median_ttft_s"] - p["min_ttft_s"]], [p["max_ttft_s"] - p["median_ttft_s"]]],
            capsize=3,
        )
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{k.split('_')[1]} streams" for k in keys])
    ax.set_ylabel("output tokens/s (one stream: decode rate)")
    ax.legend(fontsize=8)
    bx.set_xticks(range(len(rows)))
    bx.set_xticklabels([LABELS[n] for n in rows], fontsize=8)
    bx.set_ylabel(f"TTFT of a cold {args.prefill}-token prompt (s)")
    fig.suptitle(f"{args.model}, its own GGUF (median, min-max)")
    fig.tight_layout()
    save_figure(fig, path)


def table(rows: dict, args) -> None:
    keys = [f"streams_{c}" for c in args.streams]
    print_table(
        [
            "candidate",
            *[f"{k.split('_')[1]} streams tok/s" for k in keys],
            "prefill s",
            "RSS MB busy / idle / peak",
            "budget MB",
        ],
        [
            [
                LABELS[n],
                *[round(r[k]["median_tok_s"], 1) for k in keys],
                round(r["prefill"]["median_ttft_s"], 2),
                " / ".join(
                    str(round(r[f] / MB)) if f in r else "-"
                    for f in ("max_rss_bytes", "idle_rss_bytes", "peak_rss_bytes")
                ),
                round(r["rss_budget_bytes"] / MB) if "rss_budget_bytes" in r else "-",
            ]
            for n, r in rows.items()
        ],
    )


def parse():
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    srvs.add_server_flags(p, "gguf_serving", default=",".join(CANDIDATES))
    p.set_defaults(llama_gguf="own")
    add_common(p, ("rounds", {"default": 3}), "quick", "tag", ("threads", {"default": None}))
    p.add_argument("--streams", default="1,8,16", help="concurrent streams per measurement")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--prefill", type=int, default=2048, help="cold prompt length in tokens")
    args = p.parse_args()
    names = csv(args.servers)
    for n in names:
        if n not in CANDIDATES:
            p.error(f"unknown candidate {n!r}: choose from {', '.join(CANDIDATES)}")
    if args.quick:
        args.rounds, args.tokens, args.prefill, args.streams = 1, 16, 256, "1,4"
    args.streams = [int(x) for x in csv(args.streams)]
    args.threads = args.threads or args.llama_threads
    args.llama_threads = args.threads
    return args, names


def main() -> None:
    args, names = parse()
    from kvfuse.models import registry
    from kvfuse.models.tokenizer import Tokenizer
    from kvfuse_testkit import ensure_model

    ensure_model(args.home, args.model)
    gguf = srvs.model_folder(args.home, args.model) / "model.gguf"
    tokenizer = Tokenizer(srvs.model_folder(args.home, args.model))
    text = tokenizer.decode(dev_text_tokens(tokenizer, args.prefill - 24))
    asks = sharegpt_first_messages(max(args.streams))
    with contextlib.ExitStack() as stack:
        running = {n: start(args, n, stack, max(args.streams)) for n in names}
        for n, srv in running.items():  # first-use costs of the batch shapes
            base = srv.base_url if n != "llama.cpp" else srv.url + "/v1"
            streams(base, args.model, asks, f"Warm-up of {n}", 8)
        samples = interleaved(
            {n: (lambda r, n=n: measure(args, n, running[n], asks, text, r)) for n in names},
            args.rounds,
            rotate=True,
        )
        llama = running.get("llama.cpp")
        llama_info = {"command": " ".join(llama.cmd), "build": llama.version()} if llama else {}
    rows = summarize(samples, args, gguf.stat().st_size)
    rat = ratios(rows)
    result = {
        "model": args.model,
        "gguf": registry.builtin(args.model).locate(registry.builtin(args.model), args.home).name,
        "gguf_bytes": gguf.stat().st_size,
        "threads": args.threads,
        "tokens": args.tokens,
        "prefill_tokens": args.prefill,
        "rounds": args.rounds,
        "llama_server": llama_info,
        "candidates": rows,
        "ratios": rat,
        "targets": TARGETS,
        "met": met(rows, rat),
        "samples": samples,
    }
    name = output_name("gguf_serving", args.tag, args.quick)
    table(rows, args)
    print("ratios (kvfuse / llama-server):", rat, " met:", result["met"])
    print("wrote", write_json(name, result))
    plot(rows, args, name)


if __name__ == "__main__":
    main()
