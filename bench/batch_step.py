"""The runner's batched decode step, with kvfuse's CPU fast paths on and off (issue 26).

One process loads the model twice: *fast*, as ``weights: auto`` loads it on a CPU (oneDNN-packed
float32 projections, ``kvfuse.models.packed``; the batched attention kernel,
``kvfuse.models.cpu.kernels``), and *plain* (plain float32 tensors and one SDPA call per sequence and
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

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import parser
from bench.lib.results import environment, output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, median, order
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


def parse_args():
    p = parser(
        __doc__,
        "model",
        ("rounds", {"help": "interleaved rounds (default 5)"}),
        ("threads", {"default": torch.get_num_threads()}),
        "tag",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument(
        "--context", type=int, default=300, help="prompt tokens of the first sequence (default 300)"
    )
    p.add_argument("--steps", type=int, default=12, help="decode steps per sample (default 12)")
    return p.parse_args()


def measure(args, fast, plain) -> tuple[dict, dict]:
    """Interleaved rounds: each batch size once a round, fast and plain alternating which runs
    first; per batch, both modes' step seconds and the greedy agreement summed over rounds."""
    agree = {b: [0, 0] for b in args.batches}

    def batch(b: int):
        def one(r: int) -> dict[str, float]:
            modes = order(["fast", "plain"], r, alternate=True)
            runners, logits, seconds = {"fast": fast, "plain": plain}, {}, {}
            for name in modes:
                seconds[name], logits[name] = one_sample(
                    runners[name], b, args.context, args.steps, seed=r
                )
            a, t = agreement(logits["fast"], logits["plain"])
            agree[b][0] += a
            agree[b][1] += t
            return seconds

        return one

    def progress(r: int, _samples) -> None:
        print(
            f"round {r + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.2f}", flush=True
        )

    samples = interleaved({b: batch(b) for b in args.batches}, args.rounds, after_round=progress)
    return samples, agree


def _ms(xs: list[float]) -> str:
    return f"{median(xs) * 1e3:.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"


def summarize(args, samples: dict, agree: dict) -> tuple[list[dict], list[list]]:
    rows, results = [], []
    for b in args.batches:
        f, pl = [s["fast"] for s in samples[b]], [s["plain"] for s in samples[b]]
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
                *(b, _ms(f), _ms(pl), f"{res['fast_tok_s']:.1f}", f"{res['plain_tok_s']:.1f}"),
                f"{res['speedup']:.2f}x",
                f"{agree[b][0]}/{agree[b][1]}",
            ]
        )
    return results, rows


HEADERS = [
    "batch",
    "fast step ms (min-max)",
    "plain step ms (min-max)",
    "fast tok/s",
    "plain tok/s",
    "fast / plain",
    "agree",
]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernels.get()
    print(
        f"{args.model}: {args.threads} threads, kernel {'built' if kernel else 'unavailable'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    fast, plain = load_both(args.model)
    results, rows = summarize(args, *measure(args, fast, plain))
    print_table(HEADERS, rows)
    name = output_name("batch_step", args.tag)
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
    plot(results, args.model, name)


def plot(results: list[dict], model: str, name: str) -> None:
    try:
        plt = pyplot()
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
    print(f"plot: {save_figure(fig, name, dpi=120)}")


if __name__ == "__main__":
    main()
