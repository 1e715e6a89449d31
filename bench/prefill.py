"""Prefill time of kvfuse's model runner vs transformers (and llama.cpp when installed), same run.

For each model and prompt length: median of ``--runs`` prefills of real text (MuSiQue dev
documents), ours vs transformers' ``forward(..., logits_to_keep=1)`` (its fastest prefill: only the
last position's logits, as ours) on the very same converted weights, fp32 on CPU. Runs are
interleaved (ours, theirs, ours, ...) so that drift in machine speed hits both equally.
Target: ours no slower than transformers at every length.

    python bench/prefill.py                   # full: smollm2 + gemma3-270m, 512..4096, 5 runs
    python bench/prefill.py --quick           # smoke: 512/1024, 2 runs
    python bench/prefill.py --quick --device cuda --dtype bfloat16 --models smollm2   # on a GPU (both engines)
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import add_common
from bench.lib.data import dev_text_tokens
from bench.lib.results import plot_path, print_table, write_json
from bench.lib.rounds import interleaved, median


def sync(device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the call that launched them returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(model, ids: list[int]) -> float:
    runner = model.runner
    cache = runner.new_cache(len(ids), dtype=torch.float16)  # the engine's default KV dtype
    sync(runner.device)
    t = time.perf_counter()
    runner.forward(ids, cache)
    sync(runner.device)
    return time.perf_counter() - t


def time_transformers(hf_model, ids: list[int]) -> float:
    x = torch.tensor([ids], device=hf_model.device)
    sync(hf_model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        hf_model(x, logits_to_keep=1, use_cache=True)
    sync(hf_model.device)
    return time.perf_counter() - t


def llama_cpp_timer(gguf_path, max_len: int):
    """A prefill timer over llama-cpp-python on the same GGUF file, or None when not installed.

    ``gguf_path`` is a callable: the GGUF file is located (or assembled) only when needed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import os

    llm = Llama(
        model_path=str(gguf_path()),
        n_ctx=max_len + 8,
        n_batch=512,
        n_threads=os.cpu_count(),
        verbose=False,
    )

    def run(ids: list[int]) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t

    return run


def gguf_of(name: str, home):
    from kvfuse.models import registry

    model = registry.builtin(name)
    return model.locate(model, home)


def bench_model(
    name: str,
    lengths: list[int],
    runs: int,
    home,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from kvfuse.models import load_model

    ours = load_model(name, home=home, device=device, dtype=dtype)
    hf = (
        AutoModelForCausalLM.from_pretrained(ours.folder, dtype=dtype).eval().to(ours.runner.device)
    )
    ids_all = dev_text_tokens(ours.tokenizer, max(lengths))
    cpp = (
        llama_cpp_timer(lambda: gguf_of(name, home), max(lengths))
        if ours.runner.device.type == "cpu"
        else None
    )
    timers = {
        "kvfuse": functools.partial(time_ours, ours),
        "transformers": functools.partial(time_transformers, hf),
    }
    if cpp is not None:
        timers["llama.cpp"] = cpp
    for fn in timers.values():  # warm-up: one-time kernel selection, allocator growth
        fn(ids_all[: min(lengths)])
    rows = []
    for n in lengths:
        ids = ids_all[:n]

        def timed(fn, ids=ids):
            def one(_r: int) -> float:
                t = fn(ids)
                gc.collect()
                return t

            return one

        samples = interleaved({k: timed(fn) for k, fn in timers.items()}, runs)
        row = {
            "model": name,
            "tokens": n,
            "runs": samples,
            **{f"{k}_s": median(v) for k, v in samples.items()},
        }
        row["speedup_vs_transformers"] = row["transformers_s"] / row["kvfuse_s"]
        rows.append(row)
        print(
            f"  {name} {n:5d} tokens: "
            + ", ".join(f"{k} {median(v):.3f}s" for k, v in samples.items()),
            flush=True,
        )
    del hf, ours
    gc.collect()
    return rows


def plot(rows: list[dict], path, where: str = "fp32 CPU") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        mr = [r for r in rows if r["model"] == m]
        xs = [r["tokens"] for r in mr]
        for key, style in (("kvfuse_s", "o-"), ("transformers_s", "s--"), ("llama.cpp_s", "^:")):
            if key in mr[0]:
                ax.plot(xs, [r[key] for r in mr], style, label=key[:-2])
        ax.set_title(f"{m}: prefill time (median), {where}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(ap, ("models", {"default": "smollm2,gemma3-270m"}))
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    add_common(ap, "runs")
    add_common(ap, "home")
    add_common(ap, ("quick", {"help": "512 and 1024 tokens, 2 runs"}))
    add_common(ap, ("device", {"help": "cpu (default), cuda or cuda:N: both engines run there"}))
    ap.add_argument(
        "--dtype", default="float32", help="compute dtype of both engines (default float32)"
    )
    args = ap.parse_args()
    lengths = [512, 1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    runs = 2 if args.quick else args.runs
    from kvfuse.models import default_home

    home = args.home or default_home()
    from kvfuse import dtypes

    dtype = dtypes.torch_dtype(args.dtype)
    print(
        f"prefill benchmark: data = MuSiQue dev split (examples 0-49); {runs} runs per cell; "
        f"torch threads = {torch.get_num_threads()}; {args.dtype} on {args.device}"
    )
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, lengths, runs, home, args.device, dtype)
    has_cpp = any("llama.cpp_s" in r for r in rows)
    headers = ["model", "tokens", "kvfuse s", "transformers s", "speed-up"] + (
        ["llama.cpp s"] if has_cpp else []
    )
    print_table(
        headers,
        [
            [
                r["model"],
                r["tokens"],
                r["kvfuse_s"],
                r["transformers_s"],
                r["speedup_vs_transformers"],
            ]
            + ([r.get("llama.cpp_s", "-")] if has_cpp else [])
            for r in rows
        ],
    )
    ok = all(r["kvfuse_s"] <= r["transformers_s"] for r in rows)
    print(f"target: kvfuse no slower than transformers at every length: {'PASS' if ok else 'FAIL'}")
    path = write_json(
        "prefill", {"rows": rows, "target_met": ok, "device": args.device, "dtype": args.dtype}
    )
    plot(rows, plot_path("prefill"), f"{args.dtype} {args.device}")
    print(f"wrote {path} and {plot_path('prefill')}")


if __name__ == "__main__":
    main()
