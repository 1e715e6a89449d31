"""CacheBlend: answer quality and time to first token of blended prompts vs full prefill.

Quality, on fictional QA (``kvfuse/calibration/fictional_qa.py``: facts no model knows, 5 documents per item,
single- and cross-document questions, distractors; ``--split dev`` to tune, ``test`` to report):

- ``accuracy``: the gold answer appears in the greedy answer (normalised text), as a fraction of
  full prefill's accuracy on the same items (the target: >= 95% at ratio 0.15);
- ``KL``: mean KL(full prefill || method) of the next-token distributions over the full-prefill
  answer's tokens, teacher-forced (the target: at least 2x lower than full reuse's);
- ``NLL``: mean negative log-likelihood per token of the gold answer;
- ``F1``: token F1 of the greedy answer against full prefill's answer (agreement).

Speed, on MuSiQue (``../shared/data/musique_s.json``, dev examples only unless ``--split test``;
10 documents cut to ``--words`` words each, about 2.7k tokens): TTFT of full prefill, an exact
prefix hit (the same prompt again), full reuse, and the methods, with the documents in memory and
on disk after dropping the page cache (median of ``--runs``), and F1 agreement with full prefill.

Every method is run at each ``--ratios`` (recompute budgets): ``hkvd`` (CacheBlend), ``hkvd-head``,
``sinks`` (EPIC), ``sinks+hkvd``, and the variants given with ``--variants`` (check layer, K/V,
gradual filtering). Results go to ``docs/bench/blend.json`` and ``blend.png`` (quality vs TTFT).

    python bench/blend.py --part quality --items 40          # dev split, both models
    python bench/blend.py --part speed --examples 3 --runs 3
    python bench/blend.py --split test --items 100            # the reported numbers
    python bench/blend.py --combine a.json b.json             # merge runs (e.g. one process per model)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import add_common
from bench.lib.data import drop_page_cache
from bench.lib.paths import DATA, OUT
from bench.lib.results import environment, plot_path, print_table, write_json
from bench.lib.rounds import interleaved
from kvfuse.blend import BlendOptions
from kvfuse.calibration import fictional_qa
from kvfuse.calibration.measure import correct, kl, normalize
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.prompts import PromptBuilder

MODELS = ("smollm2", "gemma3-270m", "qwen2.5-0.5b")
CHAT_MODELS = ("smollm2", "qwen2.5-0.5b", "qwen2.5-1.5b")  # instruct models: asked in a chat turn
METHODS = ("hkvd", "hkvd-head", "sinks", "sinks+hkvd")
RATIOS = (0.05, 0.1, 0.15, 0.3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("quality", "speed", "all"), default="all")
    add_common(p, "split")
    add_common(p, ("models", {"default": ",".join(MODELS)}))
    p.add_argument("--items", type=int, default=40, help="fictional QA items (default 40)")
    p.add_argument(
        "--documents", type=int, default=5, help="documents per fictional QA item (default 5)"
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    p.add_argument(
        "--variants",
        default="",
        help="extra configurations, ';'-separated key=value lists over the default method, e.g. "
        "'check_layer=2;deviation=k;gradual=true;document_context=none'",
    )
    p.add_argument(
        "--default", default="", help="key=value list of the options tested as the default"
    )
    p.add_argument(
        "--examples", type=int, default=3, help="MuSiQue examples for the speed part (default 3)"
    )
    p.add_argument(
        "--words", type=int, default=200, help="words per MuSiQue document (default 200)"
    )
    p.add_argument(
        "--speed-ratios",
        default="0.05,0.1,0.15,0.3",
        help="budgets for the speed part; 'auto' is the model's calibrated blend",
    )
    add_common(p, ("runs", {"default": 3, "help": "timed runs per speed cell (default 3)"}))
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens (default 16)")
    add_common(p, "home")
    add_common(
        p,
        (
            "device",
            {"help": "cpu (default), cuda or cuda:N (compute dtype: that device's default)"},
        ),
    )
    add_common(p, ("out", {"default": str(OUT / "blend")}))
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="measure nothing: merge these runs' JSON into --out (table, JSON and plot)",
    )
    return p.parse_args(argv)


def parse_kv(text: str) -> dict:
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = part.partition("=")
        out[k] = (
            (v.lower() == "true")
            if v.lower() in ("true", "false")
            else (float(v) if "." in v else int(v))
            if re.fullmatch(r"[0-9.]+", v)
            else v
        )
    return out


# ------------------------------------------------------------------------------------ scoring


def f1(pred: str, ref: str) -> float:
    p, r = normalize(pred).split(), normalize(ref).split()
    if not p and not r:
        return 1.0
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean NLL per token of ``ids`` given the rows predicting them (row i predicts ids[i])."""
    logp = F.log_softmax(logits[: len(ids)].float(), dim=-1)
    return float(-logp[torch.arange(len(ids)), torch.tensor(ids)].mean())


# ------------------------------------------------------------------------------------ setup


def open_engine(
    name: str, home: Path, store_dir: Path | None = None, device: str = "cpu"
) -> Engine:
    from kvfuse.heap import tune as tune_allocator
    from kvfuse.models import load_model
    from kvfuse.store import TieredStore
    from kvfuse.tiers import DiskTier, MemoryTier

    tune_allocator()
    model = load_model(name, home=home, device=device, dtype="auto")
    lower = [DiskTier(store_dir, 64 << 30)] if store_dir else []
    return Engine(
        model,
        TieredStore(MemoryTier(8 << 30), lower),
        EngineSettings.of(chunk_size=256, blend=BlendOptions(store_blended=False)),
    )


def prompts_of(engine: Engine) -> PromptBuilder:
    """A prompt builder for the engine's model (documents need no context window)."""
    return PromptBuilder.for_model(engine.model, engine.context_window)


def qa_prompt(engine: Engine, model: str, it: fictional_qa.Item) -> Prompt:
    if model in CHAT_MODELS:  # an instruct model: a chat turn, documents before the question
        text = f"Answer the question using the passages above, in a few words.\nQuestion: {it.question}"
        return prompts_of(engine).document_prompt(
            list(it.documents), messages=[{"role": "user", "content": text}]
        )
    return prompts_of(engine).document_prompt(
        list(it.documents), prompt=f"Question: {it.question}\nAnswer:"
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=("\n",))


def configurations(args) -> list[tuple[str, BlendOptions]]:
    base = BlendOptions(store_blended=False, **parse_kv(args.default))
    out = [("full reuse", base.with_ratio(0.0))]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    for method in filter(None, args.methods.split(",")):
        for r in ratios:
            out.append(
                (
                    f"{method} {r:g}",
                    BlendOptions(**{**base.__dict__, "method": method, "recompute_ratio": r}),
                )
            )
    for variant in filter(None, args.variants.split(";")):
        kv = parse_kv(variant)
        label = " ".join(f"{k}={v}" for k, v in kv.items())
        for r in ratios:
            out.append(
                (
                    f"{base.method} {label} {r:g}",
                    BlendOptions(**{**base.__dict__, **kv, "recompute_ratio": r}),
                )
            )
    return out


# ------------------------------------------------------------------------------------ quality


def quality(args, model: str, home: Path) -> dict:
    engine = open_engine(model, home, device=args.device)
    data = fictional_qa.items(args.split, args.items, args.documents)
    configs = configurations(args)
    rows: dict[str, list[dict]] = {name: [] for name, _ in [("full prefill", None), *configs]}
    t0 = time.perf_counter()
    for n, it in enumerate(data):
        for name, row in quality_item(args, engine, model, it, configs).items():
            rows[name].append(row)
        if (n + 1) % 5 == 0:
            print(
                f"  {model}: {n + 1}/{len(data)} items ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    engine.close()
    return {
        "model": model,
        "split": args.split,
        "items": len(data),
        "documents": args.documents,
        "summary": quality_summary(rows),
        "per_item": rows,
        "configurations": {name: opts.__dict__ for name, opts in configs},
    }


def quality_item(args, engine: Engine, model: str, it, configs) -> dict[str, dict]:
    """One item: full prefill's answer and logits, then every configuration against them."""
    tok = engine.model.tokenizer
    params, off = greedy(args.max_tokens), CacheOptions(enabled=False)
    prompt = qa_prompt(engine, model, it)
    ref = engine.generate(prompt.ids, params, cache=off)
    ref_ids = ref.token_ids or [tok.eos_token_id or 0]
    # a chat answer starts a new turn (no leading space); a completion continues "Answer:"
    gold_ids = tok.encode(
        it.answer if model in CHAT_MODELS else " " + it.answer, add_special_tokens=False
    )
    engine.precompute_documents(it.documents)  # outside the timed requests
    ref_logits, ref_gold = engine.score(prompt.ids, [ref_ids, gold_ids], cache=off)
    out = {
        "full prefill": {
            "correct": correct(ref.text, it.answer),
            "f1": 1.0,
            "kl": 0.0,
            "nll": nll(ref_gold, gold_ids),
            "ttft_s": ref.timings.ttft_s,
            "kind": it.kind,
            "answer": ref.text,
        }
    }
    for name, opts in configs:
        got = engine.generate(prompt, params, blend=opts)
        logits, gold = engine.score(prompt, [ref_ids, gold_ids], blend=opts)
        out[name] = {
            "correct": correct(got.text, it.answer),
            "f1": f1(got.text, ref.text),
            "kl": kl(ref_logits[: len(ref_ids)], logits[: len(ref_ids)]),
            "nll": nll(gold, gold_ids),
            "ttft_s": got.timings.ttft_s,
            "kind": it.kind,
            "recomputed": got.recomputed_tokens,
            "answer": got.text,
        }
    return out


def quality_summary(rows: dict[str, list[dict]]) -> dict:
    full_acc = statistics.mean(r["correct"] for r in rows["full prefill"])
    summary = {}
    for name, rs in rows.items():
        acc = statistics.mean(r["correct"] for r in rs)
        summary[name] = {
            "accuracy": acc,
            "accuracy_vs_full": acc / full_acc if full_acc else None,
            "accuracy_single": statistics.mean(
                [r["correct"] for r in rs if r["kind"] == "single"] or [0]
            ),
            "accuracy_cross": statistics.mean(
                [r["correct"] for r in rs if r["kind"] == "cross"] or [0]
            ),
            "f1_vs_full": statistics.mean(r["f1"] for r in rs),
            "kl": statistics.mean(r["kl"] for r in rs),
            "nll_gold": statistics.mean(r["nll"] for r in rs),
            "ttft_ms_median": 1000 * statistics.median(r["ttft_s"] for r in rs),
        }
    reuse_kl = summary["full reuse"]["kl"]
    for s in summary.values():
        s["kl_vs_full_reuse"] = s["kl"] / reuse_kl if reuse_kl else None
    return summary


# ------------------------------------------------------------------------------------ speed


def musique_prompt(engine: Engine, model: str, example: dict, words: int) -> Prompt:
    docs = [" ".join(c["text"].split()[:words]) for c in example["ctxs"]]
    q = example["question"]
    if model in CHAT_MODELS:
        text = f"Answer the question using the passages above, within 5 words.\nQuestion: {q}"
        return prompts_of(engine).document_prompt(
            docs, messages=[{"role": "user", "content": text}]
        )
    return prompts_of(engine).document_prompt(docs, prompt=f"Question: {q}\nAnswer:")


def _ratio_name(base: BlendOptions, ratio) -> str:
    return "auto" if ratio == "auto" else f"{base.method} {ratio:g}"


class SpeedRounds:
    """One example's timed rounds: every configuration once per round, so that a slow stretch
    of the machine hits them all; TTFT samples, the last answers, the tokens recomputed."""

    def __init__(self, args, engine: Engine, prompt, blends, cold: list):
        self.args, self.engine, self.prompt, self.blends = args, engine, prompt, blends
        self.cold = cold  # [note]: None until the page cache was first tried
        self.params = greedy(args.max_tokens)
        self.times: dict[tuple[str, str], list[float]] = {}
        self.answers: dict[tuple[str, str], str] = {}
        self.recomputed: dict[str, int] = {}

    def round(self, _r: int) -> None:
        engine, prompt, params = self.engine, self.prompt, self.params
        off = engine.generate(prompt.ids, params, cache=CacheOptions(enabled=False))
        self.times.setdefault(("full prefill", "-"), []).append(off.timings.ttft_s)
        # Stores / promotes the plain prompt's chunks and its tail. Twice: the turn before
        # may have left a longer tail in memory (the prompt and its answer) and the prompt's
        # own tail on disk only; the second run promotes that one.
        engine.generate(prompt.ids, greedy(1))
        engine.generate(prompt.ids, greedy(1))
        hit = engine.generate(prompt.ids, params)
        if set(hit.hit_tiers) != {"memory"}:
            raise RuntimeError(f"prefix hit served from {hit.hit_tiers}")
        self.times.setdefault(("prefix hit", "memory"), []).append(hit.timings.ttft_s)
        self.answers[("prefix hit", "memory")] = hit.text
        for name, opts in self.blends:
            for tier in ("memory", "disk"):
                self.blend_cell(name, opts, tier)

    def blend_cell(self, name: str, opts, tier: str) -> None:
        engine = self.engine
        if tier == "disk":
            engine.flush()  # no save still queued lands in memory after the clear
            engine.cache.store.memory.clear()
            if self.cold[0] is None:
                self.cold[0] = drop_page_cache()
                if self.cold[0] is None:
                    self.cold[0] = "dropped before every disk run"
            if self.cold[0].startswith("dropped"):
                drop_page_cache()
        r = engine.generate(self.prompt, self.params, blend=opts)  # a disk hit is promoted
        if set(r.hit_tiers) != {tier}:
            raise RuntimeError(f"{tier} cell served from {r.hit_tiers}")
        self.times.setdefault((name, tier), []).append(r.timings.ttft_s)
        self.answers[(name, tier)] = r.text
        self.recomputed[name] = r.recomputed_tokens

    def cells(self, ex: int, ref) -> list[dict]:
        out = []
        for (name, tier), ts in self.times.items():
            answer = self.answers.get((name, tier), ref.text)
            out.append(
                {
                    "example": ex,
                    "tokens": len(self.prompt),
                    "config": name,
                    "tier": tier,
                    "ttft_s": ts,
                    "f1": f1(answer, ref.text),
                    "recomputed": self.recomputed.get(name),
                    "answer": answer,
                }
            )
        return out


def speed(args, model: str, home: Path) -> dict:
    rows = json.loads((DATA / "musique_s.json").read_text())
    examples = list(range(0, 50) if args.split == "dev" else range(50, 150))[: args.examples]
    base = BlendOptions(store_blended=False, **parse_kv(args.default))
    ratios = [r if r == "auto" else float(r) for r in args.speed_ratios.split(",") if r]
    blends = [("full reuse", base.with_ratio(0.0))] + [
        (_ratio_name(base, r), base.with_ratio(r)) for r in ratios
    ]
    params = greedy(args.max_tokens)
    cold = [None if not args.no_drop_caches else "skipped"]
    cells = []
    with tempfile.TemporaryDirectory(prefix="kvfuse-blend-") as d:
        engine = open_engine(model, home, Path(d), args.device)
        if not engine.cache.resolve(base.with_ratio("auto")).blends:
            blends = [(n, o) for n, o in blends if o.recompute_ratio != "auto"]  # prefix reuse only
        for ex in examples:
            prompt = musique_prompt(engine, model, rows[ex], args.words)
            ref = engine.generate(prompt.ids, params, cache=CacheOptions(enabled=False))
            engine.generate(prompt, greedy(1), blend=blends[0][1])  # precomputes the documents
            engine.flush()
            rounds = SpeedRounds(args, engine, prompt, blends, cold)
            interleaved({"all": rounds.round}, args.runs)
            cells += rounds.cells(ex, ref)
            print(f"  {model} example {ex} done", flush=True)
        engine.close()
    return {
        "model": model,
        "split": args.split,
        "examples": examples,
        "words_per_document": args.words,
        "tokens": [c["tokens"] for c in cells if c["config"] == "full prefill"],
        "drop_caches": cold[0],
        "summary": speed_summary(cells),
        "cells": cells,
    }


def speed_summary(cells: list[dict]) -> dict:
    summary = {}
    for c in cells:
        s = summary.setdefault(f"{c['config']} | {c['tier']}", {"ttft_s": [], "f1": []})
        s["ttft_s"].append(statistics.median(c["ttft_s"]))
        s["f1"].append(c["f1"])
    full = statistics.median(summary["full prefill | -"]["ttft_s"])
    out = {}
    for key, s in summary.items():
        med = statistics.median(s["ttft_s"])
        out[key] = {
            "ttft_ms_median": 1000 * med,
            "ttft_ms_min": 1000 * min(s["ttft_s"]),
            "ttft_ms_max": 1000 * max(s["ttft_s"]),
            "speedup_vs_full_prefill": full / med,
            "f1_vs_full": statistics.mean(s["f1"]),
        }
    return out


# ------------------------------------------------------------------------------------ report


def report(result: dict) -> None:
    for q in result.get("quality", []):
        print(
            f"\nquality: {q['model']}, fictional QA {q['split']} split, {q['items']} items x {q['documents']} documents"
        )
        rows = [
            [
                name,
                s["accuracy"],
                s["accuracy_vs_full"],
                s["f1_vs_full"],
                s["kl"],
                s["kl_vs_full_reuse"],
                s["nll_gold"],
                s["ttft_ms_median"],
            ]
            for name, s in q["summary"].items()
        ]
        print_table(
            ["config", "acc", "acc/full", "F1 vs full", "KL", "KL/reuse", "NLL gold", "TTFT ms"],
            rows,
        )
    for sp in result.get("speed", []):
        print(
            f"\nspeed: {sp['model']}, MuSiQue {sp['split']} examples {sp['examples']}, tokens {sp['tokens']}, "
            f"page cache: {sp['drop_caches']}"
        )
        rows = [
            [
                k,
                s["ttft_ms_median"],
                s["ttft_ms_min"],
                s["ttft_ms_max"],
                s["speedup_vs_full_prefill"],
                s["f1_vs_full"],
            ]
            for k, s in sp["summary"].items()
        ]
        print_table(["config | tier", "TTFT ms", "min", "max", "speed-up", "F1 vs full"], rows)


def _method_of(name: str) -> tuple[str, float | None]:
    """("hkvd", 0.15) for "hkvd 0.15"; (name, None) for the baselines."""
    head, _, tail = name.rpartition(" ")
    try:
        return head, float(tail)
    except ValueError:
        return name, None


def plot(result: dict, path: Path) -> None:
    """Per model: QA accuracy (vs full prefill's) and mean KL (vs full reuse's) against TTFT, one
    line per method through its ratios. TTFT is the MuSiQue one (memory) where the speed part
    measured the configuration, else the fictional QA one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    qs = result.get("quality", [])
    if not qs:
        return
    fig, axes = plt.subplots(2, len(qs), figsize=(6.5 * len(qs), 9), squeeze=False)
    for col, q in enumerate(qs):
        lines: dict[str, list[tuple[float, float, float, float | None]]] = {}
        for name, s in q["summary"].items():
            method, ratio = _method_of(name)
            lines.setdefault(method, []).append(
                (
                    s["ttft_ms_median"],
                    s["accuracy_vs_full"] or 0.0,
                    s["kl_vs_full_reuse"] or 0.0,
                    ratio,
                )
            )
        for row, (metric, label) in enumerate(
            ((1, "QA accuracy / full prefill's"), (2, "mean KL / full reuse's"))
        ):
            ax = axes[row][col]
            for method, pts in lines.items():
                pts.sort(key=lambda p: (p[3] is None, p[3]))
                ax.plot(
                    [p[0] for p in pts],
                    [p[metric] for p in pts],
                    marker="o",
                    label=method,
                    linestyle="-" if len(pts) > 1 else "none",
                )
                for p in pts:
                    if p[3] is not None:
                        ax.annotate(f"{p[3]:g}", (p[0], p[metric]), fontsize=6)
            ax.set_xlabel("TTFT ms (fictional QA prompts, documents in memory)")
            ax.set_ylabel(label)
            ax.set_title(f"{q['model']}: {label} ({q['split']} split, {q['items']} items)")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def combine(paths: list[str]) -> dict:
    """One result from several runs' JSON (e.g. one process per model): their quality and speed
    parts side by side."""
    out = {
        "benchmark": "blend",
        "environment": environment(),
        "runs": [],
        "quality": [],
        "speed": [],
    }
    for p in paths:
        r = json.loads(Path(p).read_text())
        out["runs"].append({"file": p, "environment": r["environment"], "split": r.get("split")})
        out["quality"] += r.get("quality", [])
        out["speed"] += r.get("speed", [])
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvfuse.config import default_home

    home = Path(args.home) if args.home else default_home()
    result = {
        "benchmark": "blend",
        "environment": environment(),
        "split": args.split,
        "device": args.device,
        "quality": [],
        "speed": [],
    }
    if args.combine:
        result = combine(args.combine)
    for model in filter(None, args.models.split(",") if not args.combine else ()):
        if args.part in ("quality", "all"):
            result["quality"].append(quality(args, model, home))
        if args.part in ("speed", "all"):
            result["speed"].append(speed(args, model, home))
    report(result)
    out = Path(args.out)
    print(f"wrote {write_json(out, result, add_environment=False, indent=1, default=str)}")
    plot(result, plot_path(out))


if __name__ == "__main__":
    main()
