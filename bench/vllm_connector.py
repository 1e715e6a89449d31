"""Time to first token of a repeated long prompt after a vLLM restart: vLLM alone vs vLLM with
kvfuse's KV connector (disk tier, Redis tier).

What is measured (SmolLM2 on vLLM CPU 0.32, bf16, one server at a time, 2-core machine):

1. *populate*: one vLLM with the connector writing to a disk folder and to a redis-server this
   script starts computes every prompt once (its greedy answers are the reference) and saves its
   chunks to both tiers;
2. rounds: each round starts, per configuration, a **new** vLLM process (nothing in its own prefix
   cache) and sends every prompt once, streaming, timing the first token:
   - ``vllm``: vLLM alone (prefix caching on, as always): a full prefill;
   - ``kvfuse-disk``: the connector with its disk tier only; after start-up and warm-up the KV files
     are evicted from the page cache (``posix_fadvise DONTNEED``; ``--drop-all-caches``: the whole
     page cache, vLLM's own libraries included), so the chunks are read from the disk itself;
   - ``kvfuse-redis``: the connector with its Redis tier only (disk off);
   - optionally ``kvfuse-disk-layerwise`` / ``kvfuse-redis-layerwise``: the same with ``layerwise:
     true`` (layer by layer during the forward pass; on the CPU the connector's default, ``auto``,
     reads whole entries before it);
   and then, in the ``vllm`` server, every prompt a second time: ``vllm-warm``, vLLM's own prefix
   cache in the same process (the floor no connector can beat: the same last-token compute);
   the configurations' order rotates from round to round (interleaved).

Each server first answers a short warm-up prompt. The machine's 1-minute load average before each
timed request is recorded (the 2 cores may be shared with other work). Every answer is compared with the reference
(greedy, 16 tokens). Cells: median (min-max) over rounds x prompts of a length. Target: the
connector >= 5x faster than vLLM alone. Prompts: token ids of MuSiQue **dev** documents
(``../shared/data/musique_s.json``), non-overlapping slices (no shared prefix between prompts).
Results: ``docs/bench/vllm_connector.json`` and ``.png``.

    python bench/vllm_connector.py                      # 2 lengths x 2 prompts, 3 rounds (~45 min)
    python bench/vllm_connector.py --quick              # one 2048-token prompt, one round
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import add_common
from bench.lib.data import drop_page_cache
from bench.lib.paths import DATA, OUT
from bench.lib.results import environment, plot_path, print_table, write_json
from bench.lib.rounds import interleaved, order, spread
from bench.lib.vllm import (
    DEFAULT_PYTHON,
    VLLMServer,
    connector_config,
    default_model_path,
    first_token,
    metric_total,
    scrape_metrics,
)
from kvfuse_testkit import LocalRedis

CONFIGS = ("vllm", "kvfuse-disk", "kvfuse-redis")
EXTRA_CONFIGS = (
    "kvfuse-disk-layerwise",
    "kvfuse-redis-layerwise",
)  # layerwise: true (the CPU default is false)
TARGET = 5.0
CHUNK = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--lengths", default="2048,4000", help="prompt lengths in tokens (default 2048,4000)"
    )
    p.add_argument("--prompts", type=int, default=2, help="distinct prompts per length (default 2)")
    add_common(p, ("rounds", {"default": 3, "help": "vLLM restarts per configuration (default 3)"}))
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"subset of {','.join(CONFIGS + EXTRA_CONFIGS)} (default {','.join(CONFIGS)})",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    add_common(p, ("quick", {"help": "one 2048-token prompt, one round"}))
    add_common(
        p, ("home", {"help": "kvfuse home holding the converted model (default $KVFUSE_HOME)"})
    )
    p.add_argument("--python", default=DEFAULT_PYTHON, help="vLLM's interpreter")
    p.add_argument("--data", default=str(DATA / "musique_s.json"))
    p.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="keep the KV files in the page cache for kvfuse-disk",
    )
    p.add_argument(
        "--drop-all-caches",
        action="store_true",
        help="drop the whole page cache (root) instead of evicting only the KV files (which also "
        "evicts vLLM's own libraries: the next request pays for reading them back)",
    )
    add_common(p, ("out", {"default": str(OUT / "vllm_connector")}))
    p.add_argument("--keep", help="keep the servers' logs and the disk tier in this folder")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.prompts, args.rounds = "2048", 1, 1
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.configs = [c for c in args.configs.split(",") if c]
    if set(args.configs) - set(CONFIGS + EXTRA_CONFIGS) or args.rounds < 1 or args.prompts < 1:
        p.error(
            f"--configs must be a subset of {CONFIGS + EXTRA_CONFIGS}; --rounds and --prompts >= 1"
        )
    return args


def make_prompts(
    folder: Path, data: Path, lengths: list[int], per_length: int
) -> dict[int, list[list[int]]]:
    """Non-overlapping slices of MuSiQue dev documents' token ids: ``per_length`` prompts per length."""
    from bench.lib.data import musique
    from kvfuse.models.tokenizer import Tokenizer

    if not data.is_file():
        raise SystemExit(f"{data} not found (MuSiQue, see docs/benchmarks.md)")
    tok = Tokenizer(folder)
    need = sum(lengths) * per_length
    ids: list[int] = []
    for ex in musique("dev"):
        for ctx in ex["ctxs"]:
            ids += tok.encode(ctx["text"] + "\n\n", add_special_tokens=False)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"the dev split holds {len(ids)} tokens, {need} needed")
    out: dict[int, list[list[int]]] = {}
    at = 0
    for n in lengths:
        out[n] = []
        for _ in range(per_length):
            out[n].append(ids[at : at + n])
            at += n
    return out


def server_for(
    config: str, args, folder: Path, work: Path, redis_url: str | None, log: Path
) -> VLLMServer:
    extra = {"memory_bytes": "1GiB"}
    if config == "populate":
        extra |= {"disk_path": str(work / "kv"), "redis_url": redis_url}
    elif config.startswith("kvfuse-disk"):
        extra |= {"disk_path": str(work / "kv")}
    elif config.startswith("kvfuse-redis"):
        extra |= {"disk": False, "redis_url": redis_url}
    if config.endswith("-layerwise"):
        extra |= {"layerwise": True}
    kv = None if config == "vllm" else connector_config(extra)
    return VLLMServer(
        folder, python=args.python, dtype=args.dtype, kv_transfer_config=kv, log_path=log
    )


def evict_files(folder: Path) -> str | None:
    """Evict the files under ``folder`` from the page cache (``POSIX_FADV_DONTNEED`` after an
    fsync), leaving every other page cached; None on success, else why not."""
    try:
        for path in folder.rglob("*.kvf"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return None
    except (OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"


def stats(xs: list[float]) -> dict:
    return {**spread(xs), "n": len(xs), "samples": xs}


class Bench:
    """One invocation: the prompts, a redis-server, the work folder, and what the rounds record."""

    def __init__(self, args):
        self.args = args
        home = Path(args.home) if args.home else None
        self.folder = default_model_path(home)
        self.prompts = make_prompts(self.folder, Path(args.data), args.lengths, args.prompts)
        self.flat = [(n, i, p) for n in args.lengths for i, p in enumerate(self.prompts[n])]
        self.expected_chunks = sum(len(p) // CHUNK for _, _, p in self.flat)
        self.work = (
            Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvfuse-vllm-bench-"))
        )
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict[int, list[float]]] = {
            c: {n: [] for n in args.lengths} for c in [*CONFIGS, *EXTRA_CONFIGS, "vllm-warm"]
        }
        self.mismatches: dict[str, int] = {}
        self.engines: list[dict] = []
        self.requests: list[dict] = []  # every timed request, with the load average before it
        self.reference: dict[tuple[int, int], str] = {}
        # a short prompt no test prompt starts with
        self.warmup = [int(x) for x in self.prompts[args.lengths[0]][0][-64:]][::-1]
        self.redis_url = ""

    def server(self, config: str, log: Path) -> VLLMServer:
        return server_for(config, self.args, self.folder, self.work, self.redis_url, log)

    def populate(self) -> None:
        """One vLLM with the connector computes every prompt (the reference answers) and saves
        its chunks to the disk and Redis tiers."""
        with self.server("populate", self.work / "populate.log") as s:
            print(f"populate: vLLM up after {s.startup_s:.0f} s", file=sys.stderr)
            for n, i, p in self.flat:
                ttft, text, _ = first_token(s.base_url, p, self.args.max_tokens)
                self.reference[(n, i)] = text
                print(f"  computed {n}-token prompt {i}: TTFT {ttft:.2f} s", file=sys.stderr)
            deadline = time.monotonic() + 300
            while saved_chunks(s.url) < self.expected_chunks:
                if time.monotonic() > deadline:
                    raise SystemExit("the populate server did not save every chunk")
                time.sleep(1)
            time.sleep(3)  # the lower tiers are written by a background thread
            saved = saved_chunks(s.url)
        import redis as redis_lib

        keys = redis_lib.Redis.from_url(self.redis_url).dbsize()
        files = len(list((self.work / "kv").glob("*/*.kvf")))
        print(
            f"populate: {saved:.0f} chunks saved; {files} files on disk, {keys} Redis keys",
            file=sys.stderr,
        )
        if files < self.expected_chunks or keys < self.expected_chunks:
            raise SystemExit(f"expected {self.expected_chunks} chunks in each tier")

    def one_config(self, r: int, config: str) -> None:
        """A new vLLM for ``config``: warm-up, the page cache dropped where asked, every prompt
        once (the order rotating with the round); in ``vllm``, every prompt again (vllm-warm)."""
        a = self.args
        with self.server(config, self.work / f"round{r}-{config}.log") as s:
            first_token(s.base_url, self.warmup, 4)
            drops = config.startswith("kvfuse-disk") and not a.no_drop_caches
            dropped = None
            if drops:
                dropped = drop_page_cache() if a.drop_all_caches else evict_files(self.work / "kv")
                if dropped is not None:
                    print(f"  page cache not dropped: {dropped}", file=sys.stderr)
            cells = order(self.flat, r, rotate=True)
            for n, i, p in cells:
                self.timed(s, config, r, n, i, p, verbose=True)
            if config == "vllm":
                for n, i, p in cells:
                    self.timed(s, "vllm-warm", r, n, i, p, verbose=False)
            time.sleep(6)  # vLLM publishes the connector's counters every few seconds
            self.engines.append(engine_record(s, r, config, dropped is None if drops else None))

    def timed(self, s, config: str, r: int, n: int, i: int, p, verbose: bool) -> None:
        load_before = os.getloadavg()[0]
        ttft, text, _ = first_token(s.base_url, p, self.args.max_tokens)
        same = text == self.reference[(n, i)]
        self.results[config][n].append(ttft)
        self.requests.append(
            {"round": r, "config": config, "tokens": n, "prompt": i, "ttft_s": ttft}
            | {"same_answer": same, "loadavg_1m": load_before}
            | ({} if same or not verbose else {"answer": text})
        )
        if not same:
            self.mismatches[config] = self.mismatches.get(config, 0) + 1
        if verbose:
            print(
                f"round {r} {config:12s} {n}-token prompt {i}: TTFT {ttft:.3f} s"
                f"{'' if same else '  (answer differs!)'}",
                file=sys.stderr,
            )

    def run(self) -> None:
        redis = LocalRedis(shutil.which("redis-server") or "redis-server").start()
        self.redis_url = f"redis://127.0.0.1:{redis.port}/0"
        try:
            self.populate()
            configs = {c: (lambda r, c=c: self.one_config(r, c)) for c in self.args.configs}
            interleaved(configs, self.args.rounds, rotate=True)
        finally:
            redis.stop()
            if not self.args.keep:
                shutil.rmtree(self.work, ignore_errors=True)


def saved_chunks(url: str) -> float:
    return metric_total(scrape_metrics(url), "vllm:kvfuse_saved_chunks_total")


def engine_record(s: VLLMServer, r: int, config: str, page_cache_dropped: bool | None) -> dict:
    """What the server's metrics and log say about one configuration's run."""
    m = scrape_metrics(s.url)
    mode = re.search(r"layerwise loads (\w+)", s.log_tail(2_000_000))
    return {
        "round": r,
        "config": config,
        "startup_s": s.startup_s,
        "layerwise_loads": mode.group(1) if mode else None,
        "page_cache_dropped": page_cache_dropped,
        "loaded_chunks": {
            t: metric_total(m, "vllm:kvfuse_loaded_chunks_by_tier_total", tier=t)
            for t in ("memory", "disk", "redis")
        },
        "load_failed_chunks": metric_total(m, "vllm:kvfuse_load_failed_chunks_total"),
        "external_prefix_cache_hits": metric_total(m, "vllm:external_prefix_cache_hits_total"),
        "prefix_cache_hits": metric_total(m, "vllm:prefix_cache_hits_total"),
    }


def print_summary(summary: dict, lengths: list[int], mismatches: dict) -> None:
    rows = []
    shown = [c for c in [*CONFIGS, *EXTRA_CONFIGS, "vllm-warm"] if c in summary]
    for n in lengths:
        base = summary["vllm"][n]["median"] if summary.get("vllm", {}).get(n) else None
        row = [n]
        for c in shown:
            s = summary.get(c, {}).get(n)
            row.append(f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})" if s else "-")
            if c != "vllm":
                row.append(f"{base / s['median']:.1f}x" if s and base else "-")
        rows.append(row)
    print_table(["tokens"] + [h for c in shown for h in ([c] if c == "vllm" else [c, "x"])], rows)
    print(f"answers differing from the reference: {mismatches or 'none'}")


def payload(b: Bench, summary: dict) -> dict:
    import subprocess

    args = b.args
    probe = subprocess.run(
        [args.python, "-c", "import kvfuse; print(kvfuse.__file__)"], capture_output=True, text=True
    )
    return {
        "environment": environment(),
        "server_kvfuse": probe.stdout.strip(),  # the kvfuse the vLLM servers import (their cwd's, else the venv's)
        "args": {k: v for k, v in vars(args).items()},
        "target_speedup": TARGET,
        "ttft_s": {c: {str(n): v for n, v in cells.items()} for c, cells in summary.items()},
        "speedup_vs_vllm": {
            c: {str(n): summary["vllm"][n]["median"] / v["median"] for n, v in cells.items()}
            for c, cells in summary.items()
            if c != "vllm" and "vllm" in summary
        },
        "answers_differing": b.mismatches,
        "engines": b.engines,
        "requests": b.requests,
        "prompts": {str(n): [len(p) for p in ps] for n, ps in b.prompts.items()},
        "reference_answers": {f"{n}/{i}": t for (n, i), t in b.reference.items()},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # stop the servers and redis-server on SIGTERM too
    b = Bench(args)
    b.run()
    summary = summarize(b.results, args.lengths)
    print_summary(summary, args.lengths, b.mismatches)
    path = write_json(Path(args.out), payload(b, summary))
    png = plot_path(Path(args.out))
    plot(summary, args.lengths, png)
    print(f"wrote {path} and {png}")
    return 0


def summarize(results: dict[str, dict[int, list[float]]], lengths: list[int]) -> dict:
    return {
        c: {n: stats(xs) for n, xs in cells.items() if xs}
        for c, cells in results.items()
        if any(cells[n] for n in lengths)
    }


def plot(summary: dict, lengths: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    configs = [c for c in (*CONFIGS, *EXTRA_CONFIGS, "vllm-warm") if c in summary]
    labels = {
        "vllm": "vLLM alone (restarted)",
        "kvfuse-disk": "vLLM + kvfuse, disk tier (KV files not cached)",
        "kvfuse-redis": "vLLM + kvfuse, Redis tier",
        "vllm-warm": "vLLM's own prefix cache (same process)",
        "kvfuse-disk-layerwise": "vLLM + kvfuse, disk, layerwise: true",
        "kvfuse-redis-layerwise": "vLLM + kvfuse, Redis, layerwise: true",
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        xs, med, lo, hi = [], [], [], []
        for k, n in enumerate(lengths):
            s = summary[c].get(n)
            if not s:
                continue
            xs.append(k + (j - (len(configs) - 1) / 2) * width)
            med.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=labels[c])
        if c != "vllm" and "vllm" in summary:
            for x, m, n in zip(xs, med, lengths):
                ax.annotate(
                    f"{summary['vllm'][n]['median'] / m:.1f}x",
                    (x, m),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 3),
                    textcoords="offset points",
                )
        del bars
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("time to first token after a restart (s)")
    ax.set_title("SmolLM2 on vLLM CPU (bf16): a repeated prompt after a restart")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
