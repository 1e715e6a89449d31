"""The runner's batched decode step, with kvfuse's CPU fast paths on and off (issue 26).

One process loads the model twice: *fast*, as ``weights: auto`` loads it on a CPU (oneDNN-packed
float32 projections, ``kvfuse.models.packed``; the batched attention kernel,
``kvfuse.models.kernels``), and *plain* (plain float32 tensors and one SDPA call per sequence and
layer, the path of ``KVFUSE_KERNELS=off``). For each batch size, sequences of different lengths
(``--context`` tokens plus 7 per sequence, fp16 KV as the server keeps it) are prefilled, then
``--steps`` decode steps of all of them run through ``Transformer.forward_batch``; the median step
time is one sample. Modes alternate within every round (``--rounds``), so both see the same
machine load; the table gives the median over rounds with min and max, tokens/s (sequences /
step time) and the fast/plain ratio. Both modes' greedy tokens are compared step by step
("agree": identical argmax, or a near tie within 1e-3 of the top logit).

    python bench/batch_step.py                # smollm2, batch 1 4 16 32, 5 rounds
    python bench/batch_step.py --model qwen2.5-0.5b --batches 1 16

Writes ``docs/bench/batch_step.json`` and ``batch_step.png`` (``--tag T``: ``batch_step-T``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import environment, median, plot_path, print_table, write_json

from kvfuse.models import load_model
from kvfuse.models.cpu import kernels
from kvfuse.models.transformer import BatchItem


def load_both(model: str):
    """(fast, plain) runners of ``model`` in float32 on the CPU."""
    fast = load_model(model, device="cpu", dtype="float32").runner
    os.environ["KVFUSE_KERNELS"] = "off"
    try:
        plain = load_model(model, device="cpu", dtype="float32").runner
    finally:
        del os.environ["KVFUSE_KERNELS"]
    plain.use_kernels = False
    return fast, plain


def one_sample(
    runner, batch: int, context: int, steps: int, seed: int
) -> tuple[float, list[list[torch.Tensor]]]:
    """Median decode-step seconds of ``batch`` sequences, and each step's logits."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for i in range(batch):
        cache = runner.new_cache(context + 7 * i + steps + 8, torch.float16)
        runner.forward(
            torch.randint(100, 20000, (context + 7 * i,), generator=g), cache, logits="none"
        )
        caches.append(cache)
    tokens = [1000 + i for i in range(batch)]
    times, logits = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = runner.forward_batch([BatchItem([t], c) for t, c in zip(tokens, caches)])
        times.append(time.perf_counter() - t0)
        tokens = [int(o.argmax()) for o in out]
        logits.append(out)
    return statistics.median(times[1:]), logits


def agreement(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> tuple[int, int]:
    """(steps whose greedy tokens agree or nearly tie, all steps), over every sequence; stops
    comparing a sequence at its first disagreement (its inputs differ afterwards)."""
    agree = total = 0
    for seq in range(len(a[0])):
        for step_a, step_b in zip(a, b):
            x, y = step_a[seq], step_b[seq]
            total += 1
            tx, ty = int(x.argmax()), int(y.argmax())
            if tx == ty or abs(float(x[tx] - x[ty])) < 1e-3:
                agree += 1
            else:
                break
    return agree, total


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument(
        "--context", type=int, default=300, help="prompt tokens of the first sequence (default 300)"
    )
    p.add_argument("--steps", type=int, default=12, help="decode steps per sample (default 12)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tag")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernels.get()
    print(
        f"{args.model}: {args.threads} threads, kernel {'built' if kernel else 'unavailable'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    fast, plain = load_both(args.model)
    samples = {(m, b): [] for m in ("fast", "plain") for b in args.batches}
    agree = {b: [0, 0] for b in args.batches}
    for r in range(args.rounds):
        for b in args.batches:
            order = (
                [("fast", fast), ("plain", plain)]
                if r % 2 == 0
                else [("plain", plain), ("fast", fast)]
            )
            logits = {}
            for name, runner in order:
                seconds, logits[name] = one_sample(runner, b, args.context, args.steps, seed=r)
                samples[(name, b)].append(seconds)
            a, t = agreement(logits["fast"], logits["plain"])
            agree[b][0] += a
            agree[b][1] += t
        print(
            f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True
        )
    rows, results = [], []
    for b in args.batches:
        f, pl = samples[("fast", b)], samples[("plain", b)]
        res = {
            "batch": b,
            "fast_ms": [x * 1e3 for x in f],
            "plain_ms": [x * 1e3 for x in pl],
            "fast_tok_s": b / median(f),
            "plain_tok_s": b / median(pl),
            "speedup": median(pl) / median(f),
            "agree": agree[b],
        }
        results.append(res)
        rows.append(
            [
                b,
                f"{median(f) * 1e3:.1f} ({min(f) * 1e3:.1f}-{max(f) * 1e3:.1f})",
                f"{median(pl) * 1e3:.1f} ({min(pl) * 1e3:.1f}-{max(pl) * 1e3:.1f})",
                f"{res['fast_tok_s']:.1f}",
                f"{res['plain_tok_s']:.1f}",
                f"{res['speedup']:.2f}x",
                f"{agree[b][0]}/{agree[b][1]}",
            ]
        )
    print_table(
        [
            "batch",
            "fast step ms (min-max)",
            "plain step ms (min-max)",
            "fast tok/s",
            "plain tok/s",
            "fast / plain",
            "agree",
        ],
        rows,
    )
    name = f"batch_step-{args.tag}" if args.tag else "batch_step"
    write_json(
        name,
        {
            "model": args.model,
            "context": args.context,
            "steps": args.steps,
            "rounds": args.rounds,
            "threads": args.threads,
            "kernel": kernel is not None,
            "results": results,
            "environment": environment(),
            "load_average_after": os.getloadavg()[0],
        },
    )
    plot(results, args.model, plot_path(name))


def plot(results: list[dict], model: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch"] for r in results]
    for key, label in (("fast_tok_s", "kernel + packed weights"), ("plain_tok_s", "plain PyTorch")):
        ax.plot(xs, [r[key] for r in results], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per step")
    ax.set_ylabel("decode tokens/s (runner)")
    ax.set_title(f"{model}: batched decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
