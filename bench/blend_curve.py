"""The quality of blending by model size: accuracy, KL and TTFT against the recompute budget.

For each built-in model, on the **test** split of fictional QA (``kvfuse.calibration.fictional_qa``;
the budgets were chosen on dev by ``kvfuse calibrate``), this measures full prefill, full reuse,
each ``--methods`` selection method at each ``--ratios`` budget (with the document context of
the model's profile, and with each of ``--contexts``), and the model's ``auto`` blend (its
shipped profile: the method and budget calibration chose, or no blending), with
``kvfuse.calibration.measure``:

- accuracy: correct answers as a fraction of full prefill's (the target: >= 0.95);
- KL: mean KL(full prefill || blend) along full prefill's answer, as a fraction of full reuse's
  (the target: <= 0.5);
- NLL: the mean negative log-likelihood of full prefill's answer, nats per token;
- TTFT: the median time to first token with the documents' KV in memory, as a fraction of a full
  prefill's.

``--methods`` takes the engine's ``blend.method`` values (the serving path). The issue-41 levers
that are not (yet) methods (APE, anchor blocks, ``attn+hkvd``, layer-split recompute) are measured
side by side at the runner's level by ``bench/blend_loss.py`` (see ``docs/blend.md``).

Writes ``docs/bench/blend_curve.json`` and ``blend_curve.png`` (accuracy and KL against the
budget, one line per model).

    python bench/blend_curve.py --items 20
    python bench/blend_curve.py --models qwen2.5-1.5b --items 10 --out /tmp/q15   # one model per process
    python bench/blend_curve.py --combine a.json b.json                             # merge runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import add_common, csv
from bench.lib.paths import OUT
from bench.lib.results import environment, plot_path, print_table, write_json
from kvfuse.calibration import fictional_qa
from kvfuse.calibration.measure import configurations, measure
from kvfuse.config import BlendOptions, EngineSettings

MODELS = ("smollm2", "gemma3-270m", "qwen2.5-0.5b", "qwen2.5-1.5b")
SIZES = {"smollm2": "135M", "gemma3-270m": "270M", "qwen2.5-0.5b": "494M", "qwen2.5-1.5b": "1.54B"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(p, ("models", {"default": ",".join(MODELS)}))
    add_common(p, ("split", {"default": "test"}))
    p.add_argument("--items", type=int, default=20)
    p.add_argument("--ratios", default="0.05,0.15,0.3,0.6")
    p.add_argument(
        "--methods", default="hkvd,sinks+hkvd", help="selection methods, comma-separated"
    )
    p.add_argument(
        "--contexts",
        default="",
        help="also each method with these document contexts (blend.document_context: bos, eos, "
        "none, prefix), comma-separated; the profile's context otherwise",
    )
    add_common(p, "home")
    add_common(p, ("out", {"default": str(OUT / "blend_curve")}))
    p.add_argument(
        "--combine", nargs="+", metavar="JSON", help="measure nothing: merge these runs' JSON"
    )
    return p.parse_args(argv)


def progress_line(model: str):
    """``measure``'s progress callback: a line per item done."""

    def line(p) -> None:
        print(f"  {model}: {p.done}/{p.total} items ({p.elapsed_s:.0f}s)", flush=True)

    return line


def run_model(model: str, args, home: Path) -> dict:
    from kvfuse.engine import Engine
    from kvfuse.models import load_model
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    loaded = load_model(model, home=home, device="cpu", dtype="auto")
    engine = Engine(
        loaded,
        TieredStore(MemoryTier(4 << 30), []),
        EngineSettings.of(chunk_size=256, blend=BlendOptions(store_blended=False)),
    )
    auto = engine.cache.blend  # the shipped profile's blend (or the conservative default)
    context = auto.document_context
    base = BlendOptions(recompute_ratio=0.15, document_context=context)
    methods = args.methods.split(",")
    variants = [{"method": m, "document_context": c} for c in csv(args.contexts) for m in methods]
    configs = configurations(methods, [float(r) for r in args.ratios.split(",")], base, variants)
    configs["auto"] = replace(auto, store_blended=False)
    items = fictional_qa.items(args.split, args.items)
    report = measure(
        engine,
        items,
        configs,
        progress=progress_line(model),
    )
    engine.close()
    full, reuse = report.tallies["full prefill"], report.tallies["full reuse"]
    reuse_kl = statistics.mean(reuse.kl)
    rows = {}
    for name, t in report.tallies.items():
        rows[name] = {
            "correct": t.correct,
            "accuracy_vs_full": t.correct / full.correct if full.correct else None,
            "kl": statistics.mean(t.kl) if t.kl else 0.0,
            "kl_vs_full_reuse": statistics.mean(t.kl) / reuse_kl if t.kl and reuse_kl else 0.0,
            "nll": statistics.mean(t.nll),
            "ttft_ms": 1000 * statistics.median(t.ttft_s),
            "ttft_vs_full": statistics.median(t.ttft_s) / statistics.median(full.ttft_s),
        }
    return {
        "model": model,
        "split": args.split,
        "items": len(items),
        "parameters": SIZES.get(model),
        "auto": {
            "method": auto.method,
            "recompute_ratio": auto.recompute_ratio,
            "source": auto.source,
            "document_context": auto.document_context,
        },
        "rows": rows,
    }


def report(results: list[dict]) -> None:
    for r in results:
        a = r["auto"]
        print(
            f"\n{r['model']} ({r.get('parameters') or '?'} parameters): {r['split']} split, {r['items']} items; auto = {a['method']} at "
            f"{a['recompute_ratio']:g} ({a['source']}, documents behind {a['document_context']})"
        )
        print_table(
            ["config", "correct", "acc/full", "KL", "KL/reuse", "NLL", "TTFT ms", "TTFT/full"],
            [
                [
                    name,
                    x["correct"],
                    x["accuracy_vs_full"],
                    x["kl"],
                    x["kl_vs_full_reuse"],
                    x["nll"],
                    x["ttft_ms"],
                    x["ttft_vs_full"],
                ]
                for name, x in r["rows"].items()
            ],
        )


def series(rows: dict[str, dict]) -> dict[str, list[tuple[float, dict]]]:
    """The curves in a model's rows: a configuration named ``"<series> <ratio>"`` (``"hkvd 0.3"``,
    ``"sinks method=sinks document_context=eos 0.15"``) is a point of its series at that budget;
    full prefill, full reuse and auto are not series. Points sorted by budget."""
    out: dict[str, list[tuple[float, dict]]] = {}
    for name, row in rows.items():
        label, _, ratio = name.rpartition(" ")
        try:
            budget = float(ratio)
        except ValueError:
            continue
        if label and name != "full reuse":
            out.setdefault(label, []).append((budget, row))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in sorted(out.items())}


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    for color, r in zip(colors, results):
        for i, (method, pts) in enumerate(series(r["rows"]).items()):
            style = styles[i % len(styles)]
            pts = [(0.0, r["rows"]["full reuse"])] + pts
            for ax, key in zip(axes, ("accuracy_vs_full", "kl_vs_full_reuse")):
                ax.plot(
                    [p[0] for p in pts],
                    [p[1][key] or 0.0 for p in pts],
                    marker="o",
                    color=color,
                    linestyle=style,
                    label=f"{r['model']} ({r.get('parameters') or '?'}) {method}",
                )
    for ax, label, target in zip(
        axes, ("accuracy / full prefill's", "KL / full reuse's"), (0.95, 0.5)
    ):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel("recompute budget")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    split = results[0]["split"] if results else ""
    fig.suptitle(f"Blending quality by model size (fictional QA, {split} split)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.combine:
        results = [r for p in args.combine for r in json.loads(Path(p).read_text())["results"]]
    else:
        from kvfuse.config import default_home

        home = Path(args.home) if args.home else default_home()
        results = [run_model(m, args, home) for m in args.models.split(",")]
    report(results)
    out = Path(args.out)
    payload = {"benchmark": "blend_curve", "environment": environment(), "results": results}
    print(f"wrote {write_json(out, payload, indent=1)}")
    plot(results, plot_path(out))


if __name__ == "__main__":
    main()
