"""Decode speed of running sequences while another request's KV loads from disk, before and after
loads moved off the engine's step (issue 37).

Eight sequences decode (short prompts, ``--decode-tokens`` each, no end-of-sequence); once all
of them have their first token, a returning conversation of ``--history`` tokens is submitted
whose KV is on disk only (written by an earlier engine, memory tier too small to hold it, page
cache dropped when the machine allows). Measured from that submission to the returning
request's first token: the eight's decode tokens per second, against the same engine's rate in
the ``BASE_S`` seconds just before; the longest gap between two decode steps (the stall the load
causes); the returning request's TTFT.

``--before REF`` runs the same measurement on the code at git ref REF (a temporary worktree,
in a child process), interleaved round by round with the working tree's: same machine, same
stretch of time. Results: ``docs/bench/offstep_load.{json,png}``.

    python bench/offstep_load.py                    # 3 rounds against the code before issue 37
    python bench/offstep_load.py --rounds 1 --history 1024 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
if "--one" in sys.argv:  # a measurement of the kvfuse on PYTHONPATH: that one comes first
    sys.path.append(str(HERE))
else:
    sys.path.insert(0, str(HERE))

from bench.lib.cli import parser  # noqa: E402  (bench/lib is this tree's, whichever kvfuse runs)
from bench.lib.data import drop_page_cache
from bench.lib.paths import REPO
from bench.lib.results import environment, output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, spread

BEFORE = "0367835"  # main before the cache engine moved loads off the step
WARM_S, BASE_S = 1.0, 3.0  # decoding alone before the window: settling, then the baseline


def parse_args(argv=None):
    p = parser(__doc__, "model", "home", ("rounds", {"default": 3}), "quick", "tag", "out")
    p.add_argument("--running", type=int, default=8, help="decoding sequences (default 8)")
    p.add_argument("--history", type=int, default=4096, help="tokens loaded from disk")
    p.add_argument("--decode-tokens", type=int, default=160, help="tokens each decoder makes")
    p.add_argument("--before", default=BEFORE, help="git ref of the code to compare with")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -------------------------------------------------------------------- one measurement (child)


def open_store(path: Path, memory_bytes: int):
    """A memory tier and a disk tier, from wherever this version of kvfuse keeps them."""
    from kvfuse.tiers import DiskTier, MemoryTier

    try:
        from kvfuse.store import TieredStore
    except ImportError:  # before store/ split off tiers/
        from kvfuse.tiers import TieredStore
    return TieredStore(MemoryTier(memory_bytes), [DiskTier(path, 8 << 30)])


def new_engine(model, store):
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine

    settings = EngineSettings.of(chunk_size=256, max_running=16, prefetch=False)
    return Engine(model, store, settings)


def write_history(model, path: Path, ids: list[int]) -> None:
    """An earlier engine computes the conversation and leaves its KV on disk."""
    from kvfuse.generation import SamplingParams

    engine = new_engine(model, open_store(path, 1 << 30))
    engine.generate(ids, SamplingParams(max_tokens=1))
    engine.close()


def measure_once(args) -> dict:
    """One window: the eight decode while the history loads (see the module docstring)."""
    import torch

    from kvfuse.engine import Prompt, Request
    from kvfuse.generation import SamplingParams
    from kvfuse.models import load_model

    torch.manual_seed(0)
    model = load_model(args.model, home=args.home, device="cpu", dtype="auto")
    vocab = model.config.vocab_size
    history = torch.randint(100, vocab - 100, (args.history,)).tolist()
    with tempfile.TemporaryDirectory(prefix="kvfuse-offstep-") as d:
        write_history(model, Path(d), history)
        cold = drop_page_cache()
        engine = new_engine(model, open_store(Path(d), 1))  # every hit read from disk
        firsts: dict[int, float] = {}
        tokens: list[tuple[float, int]] = []

        def decoder(i: int) -> Request:
            ids = torch.randint(100, vocab - 100, (32,)).tolist()
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
            return Request(Prompt.plain(ids), params, on_text=lambda _p, i=i: on_token(i))

        def on_token(i: int) -> None:
            firsts.setdefault(i, time.perf_counter())
            tokens.append((time.perf_counter(), i))

        for i in range(args.running):
            engine.submit(decoder(i))
        while len(firsts) < args.running:
            engine.step()
        return _window(engine, history, tokens, args, cold)


def _window(engine, history, tokens, args, cold) -> dict:
    """Step until the returning request's first token; the decode rates around it."""
    from kvfuse.engine import Prompt, Request
    from kvfuse.generation import SamplingParams

    warm_end = time.perf_counter() + WARM_S + BASE_S
    while time.perf_counter() < warm_end:
        engine.step()
    first: list[float] = []
    returning = Request(
        Prompt.plain(history + [11, 12, 13]),
        SamplingParams(max_tokens=2, ignore_eos=True),
        on_text=lambda _p: first or first.append(time.perf_counter()),
    )
    t0 = time.perf_counter()
    engine.submit(returning)
    steps = [t0]
    while not first and time.perf_counter() - t0 < 120:
        engine.step()
        steps.append(time.perf_counter())
    t1 = first[0] if first else time.perf_counter()
    during = sum(t0 <= t <= t1 for t, _ in tokens) / max(t1 - t0, 1e-9)
    before = sum(t0 - BASE_S <= t < t0 for t, _ in tokens) / BASE_S
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    engine.close()
    return {
        "decode_tok_s_during": during,
        "decode_tok_s_before": before,
        "ratio": during / before if before else None,
        "longest_step_gap_ms": 1000 * max(gaps, default=0.0),
        "returning_ttft_ms": 1000 * (t1 - t0),
        "page_cache": cold or "dropped",
    }


# -------------------------------------------------------------------- the comparison (parent)


def worktree(ref: str) -> Path:
    """A checkout of ``ref`` under the system's temporary folder (made once)."""
    path = Path(tempfile.gettempdir()) / f"kvfuse-bench-{ref}"
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
            check=True,
            capture_output=True,
        )
    return path


def run_child(code: Path, args) -> dict:
    """``measure_once`` on the kvfuse at ``code``, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        "--model",
        args.model,
        "--running",
        str(args.running),
        "--history",
        str(args.history),
        "--decode-tokens",
        str(args.decode_tokens),
    ]
    if args.home:
        cmd += ["--home", args.home]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"measurement at {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(args, samples: dict) -> None:
    rows, summary = [], {}
    for name, runs in samples.items():
        s = {
            key: spread([r[key] for r in runs if r[key] is not None])
            for key in (
                "decode_tok_s_before",
                "decode_tok_s_during",
                "ratio",
                "longest_step_gap_ms",
                "returning_ttft_ms",
            )
        }
        summary[name] = s
        rows.append(
            [name] + [f"{s[k]['median']:.3g} ({s[k]['min']:.3g}-{s[k]['max']:.3g})" for k in s]
        )
    print_table(
        ["code", "tok/s before", "tok/s during load", "during/before", "longest gap ms", "TTFT ms"],
        rows,
    )
    name = args.out or output_name("offstep_load", args.tag, args.quick)
    write_json(
        name,
        {"args": vars(args), "environment": environment(), "summary": summary, "runs": samples},
    )
    plot(name, summary)


def plot(name: str, summary: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(summary)
    for i, key in enumerate(("decode_tok_s_before", "decode_tok_s_during")):
        med = [summary[n][key]["median"] for n in names]
        lo = [m - summary[n][key]["min"] for m, n in zip(med, names)]
        hi = [summary[n][key]["max"] - m for m, n in zip(med, names)]
        xs = [j + 0.38 * i for j in range(len(names))]
        ax.bar(xs, med, width=0.36, yerr=[lo, hi], label=key.replace("decode_tok_s_", ""))
    ax.set_xticks([j + 0.19 for j in range(len(names))], names)
    ax.set_ylabel("decode tokens/s of the running sequences")
    ax.set_title("while a history loads from disk")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, name)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_once(args)))
        return
    if args.quick:
        args.rounds, args.history, args.decode_tokens = 1, 1024, 96
    candidates = {
        f"before ({args.before})": lambda r: run_child(worktree(args.before), args),
        "after (this tree)": lambda r: run_child(REPO, args),
    }
    report(args, interleaved(candidates, args.rounds, alternate=True))


if __name__ == "__main__":
    main()
