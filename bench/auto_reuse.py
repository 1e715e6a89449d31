"""Automatic reuse (issue 27): RAG prompts sent as one plain string through the official ``openai``
client to a real ``kvfuse serve``, with passages the cache saw before in another order.

Every request is a chat turn (a completion for the base model Gemma 3) whose text is the
retrieved passages, then calibration's instruction and the question (``measure.item_prompt``'s
text, as one string): what a RAG framework sends. The configurations, per model, on one server
(``blend.auto: on``), each in a namespace of its own (``cache_salt``):

- ``full prefill``: ``cache: false``;
- ``prefix only``: ``blend_auto: "off"``: today's prefix caching (a new order shares nothing but
  the instruction);
- ``auto <budget>``: ``blend_auto: "on"``: the passages' content chunks, stored by an earlier
  prompt with them in another order, found and blended at the model's calibrated budget
  (``auto``) or at ``recompute_ratio`` <budget>;
- ``documents <budget>``: the same passages sent as kvfuse's ``documents`` (cached before by a
  request with them in another order).

Speed (``--part speed``): MuSiQue (``../shared/data/musique_s.json``; ``--split dev``: examples
0-49, ``test``: 50-149), 10 passages cut to ``--words`` words. Per example, a warm-up request per
configuration with the passages in their order, then ``--runs`` rounds, each with a new order
sent in every configuration (interleaved). TTFT is client-side (request sent -> first streamed
content).
Reported: median TTFT, speed-up against full prefill, the share of passage tokens found in the
cache (``span_reused + recomputed``) and reused (``span_reused``), token F1 of the answer against
full prefill's and against the gold answers.

No shared content (also ``--part speed``): fresh prompts with automatic reuse on and off, each in
a namespace of its own (nothing to find), alternating which goes first (``--pairs``); and the
work automatic reuse adds to a request's path (keying, lookups), measured in-process.

Quality (``--part quality``): fictional QA (``kvfuse/calibration/fictional_qa.py``, ``--split``
dev: items 0.., test: 1000..), 5 passages per item, sent as plain prompts: accuracy (the gold
answer in the greedy answer) of full prefill, of automatic reuse after a warm-up request with the
passages in another order, and of documents, each budget in a ``cache_salt`` of its own.

    python bench/auto_reuse.py --models qwen2.5-0.5b --part speed --split dev --examples 1 --runs 1
    python bench/auto_reuse.py --models qwen2.5-0.5b,gemma3-270m --split test     # docs/bench/auto_reuse.*
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.blend import f1
from bench.lib.cli import add_common
from bench.lib.paths import DATA, OUT
from bench.lib.results import environment, plot_path, print_table, write_json
from bench.lib.rounds import interleaved
from bench.lib.rounds import order as round_order
from kvfuse.calibration import fictional_qa
from kvfuse.calibration.measure import BASE_MODELS, QUESTION, correct


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(p, ("models", {"default": "qwen2.5-0.5b"}))
    p.add_argument("--part", choices=("speed", "quality", "all"), default="all")
    add_common(p, "split")
    p.add_argument("--examples", type=int, default=2, help="MuSiQue examples (speed)")
    add_common(p, ("runs", {"default": 2, "help": "rounds per example (speed)"}))
    p.add_argument("--words", type=int, default=200, help="words per MuSiQue passage")
    p.add_argument(
        "--budgets", default="auto,0.15,0.3", help="recompute budgets of auto and documents (speed)"
    )
    p.add_argument(
        "--quality-budgets",
        default="auto",
        help="budgets of automatic reuse in the quality part (documents: at auto)",
    )
    p.add_argument("--items", type=int, default=20, help="fictional QA items (quality)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument(
        "--pairs", type=int, default=4, help="prompts sharing nothing: on/off pairs (speed)"
    )
    add_common(p, ("home", {"help": "kvfuse home (default: $KVFUSE_HOME)"}))
    add_common(
        p, ("out", {"default": str(OUT / "auto_reuse"), "help": "output path without extension"})
    )
    p.add_argument("--combine", nargs="*", help="merge earlier JSON results instead of measuring")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ requests


class Bench:
    """One model's server and client, and the request shapes of the configurations."""

    def __init__(self, model: str, home: Path, tmp: Path, max_tokens: int):
        from openai import OpenAI

        from kvfuse_testkit import ServerProcess

        self.model, self.max_tokens = model, max_tokens
        self.chat = model not in BASE_MODELS
        config = {
            "model": model,
            "cache": {"disk": False, "memory_bytes": 16 << 30},
            "blend": {"auto": "on", "auto_min_tokens": 256},
            "server": {"max_tokens_limit": 512},
        }
        t0 = time.perf_counter()
        self.server = ServerProcess(home, config=config, log_path=tmp / f"{model}.log").start(
            timeout=600
        )
        self.startup_s = time.perf_counter() - t0
        self.client = OpenAI(
            base_url=self.server.base_url, api_key="unused", max_retries=0, timeout=3600
        )

    def close(self) -> None:
        self.server.close()

    def question(self, question: str) -> str:
        """What follows the passages: calibration's instruction and question (``measure.item_prompt``)."""
        return QUESTION.format(question=question) if self.chat else f"Question: {question}\nAnswer:"

    def text(self, docs: list[str], question: str) -> str:
        """The plain RAG prompt, one string: the passages, then the question; the very text a
        request with ``documents`` renders (each passage stripped, then a blank line)."""
        return "".join(f"{d.strip()}\n\n" for d in docs) + self.question(question)

    def ask(
        self,
        docs: list[str],
        question: str,
        mode: str,
        budget: str | None = None,
        salt: str | None = None,
        max_tokens: int | None = None,
    ) -> dict:
        """One streamed request of configuration ``mode`` (full, prefix, auto, documents)."""
        extra: dict = (
            {"cache": False}
            if mode == "full"
            else {"blend_auto": "off" if mode == "prefix" else "on"}
        )
        if budget not in (None, "auto"):
            extra["recompute_ratio"] = float(budget)
        if salt:
            extra["cache_salt"] = salt
        text = self.text(docs, question)
        if mode == "documents":
            extra["documents"] = docs
            text = self.question(question)
        return self._stream(text, extra, max_tokens or self.max_tokens)

    def _stream(self, text: str, extra: dict, max_tokens: int) -> dict:
        common = dict(
            model=self.model,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        t0 = time.perf_counter()
        if self.chat:
            stream = self.client.chat.completions.create(
                messages=[{"role": "user", "content": text}], **common
            )
        else:
            stream = self.client.completions.create(prompt=text, **common)
        first, pieces, usage = None, [], None
        for chunk in stream:
            usage = chunk.usage or usage
            piece = (
                (chunk.choices[0].delta.content if self.chat else chunk.choices[0].text)
                if chunk.choices
                else None
            )
            if piece:
                first = first or time.perf_counter()
                pieces.append(piece)
        end = time.perf_counter()
        d = usage.prompt_tokens_details
        return {
            "ttft_s": (first or end) - t0,
            "text": "".join(pieces).split("\n")[0].strip(),
            "prompt_tokens": usage.prompt_tokens,
            "cached": d.cached_tokens,
            **{
                k: d.model_extra.get(k)
                for k in (
                    "span_reused_tokens",
                    "prefix_reused_tokens",
                    "recomputed_tokens",
                    "auto_reuse",
                    "blend",
                )
            },
        }


# ------------------------------------------------------------------------------------ speed


def musique(split: str) -> list[dict]:
    rows = json.loads((DATA / "musique_s.json").read_text())
    return rows[:50] if split == "dev" else rows[50:]


def configurations(budgets: list[str]) -> list[tuple[str, str, str | None]]:
    return (
        [("full prefill", "full", None), ("prefix only", "prefix", None)]
        + [(f"auto {b}", "auto", b) for b in budgets]
        + [(f"documents {b}", "documents", b) for b in budgets]
    )


def speed(args, bench: Bench, tokenizer) -> dict:
    """Per example: each configuration in a namespace of its own (``cache_salt``), warmed with the
    passages in their order; then per run one new order, sent in every configuration."""
    rows = musique(args.split)
    budgets = [b for b in args.budgets.split(",") if b]
    configs = configurations(budgets)
    # warm-ups at a budget of their own: a model whose calibrated blend is prefix stores nothing at auto
    warm = next((b for b in budgets if b != "auto"), None)
    cells = []
    for e in range(args.examples):
        ex = rows[e]
        docs = [" ".join(c["text"].split()[: args.words]) for c in ex["ctxs"]]
        doc_tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in docs)
        salts = {name: f"speed-{name}-{e}-{time.time_ns()}" for name, _, _ in configs}
        for name, mode, budget in configs:
            if mode in ("auto", "documents"):  # the passages seen before, in their order
                bench.ask(
                    docs,
                    ex["question"],
                    mode,
                    warm if budget == "auto" else budget,
                    salt=salts[name],
                    max_tokens=1,
                )
        rng = random.Random(1000 * e)
        order: list[int] = []

        def shuffle(_run: int) -> None:  # each round: a new order of the passages
            order[:] = rng.sample(range(len(docs)), len(docs))

        def config(name, mode, budget, ex=ex, e=e, docs=docs, doc_tokens=doc_tokens, salts=salts):
            def one(run: int) -> None:
                got = bench.ask(
                    [docs[i] for i in order], ex["question"], mode, budget, salt=salts[name]
                )
                cells.append(
                    {
                        "example": e,
                        "run": run,
                        "config": name,
                        "doc_tokens": doc_tokens,
                        "gold": ex["answers"],
                        **got,
                    }
                )

            return one

        interleaved(
            {name: config(name, mode, budget) for name, mode, budget in configs},
            args.runs,
            before_round=shuffle,
            after_round=lambda run, _s, e=e: print(
                f"  {bench.model}: example {e} run {run} done", flush=True
            ),
        )
    return summarize_speed(cells, configs)


def summarize_speed(cells: list[dict], configs) -> dict:
    ref = {(c["example"], c["run"]): c["text"] for c in cells if c["config"] == "full prefill"}
    full = statistics.median(c["ttft_s"] for c in cells if c["config"] == "full prefill")
    out = {}
    for name, mode, _ in configs:
        cs = [c for c in cells if c["config"] == name]
        med = statistics.median(c["ttft_s"] for c in cs)
        found = [
            ((c["span_reused_tokens"] or 0) + (c["recomputed_tokens"] or 0)) / c["doc_tokens"]
            for c in cs
        ]
        reused = [(c["span_reused_tokens"] or 0) / c["doc_tokens"] for c in cs]
        out[name] = {
            "ttft_ms_median": 1000 * med,
            "speedup_vs_full_prefill": full / med,
            "doc_tokens_found": statistics.mean(found),
            "doc_tokens_reused": statistics.mean(reused),
            "f1_vs_full": statistics.mean(f1(c["text"], ref[(c["example"], c["run"])]) for c in cs),
            "f1_gold": statistics.mean(max(f1(c["text"], g) for g in c["gold"]) for c in cs),
            "prompt_tokens": statistics.mean(c["prompt_tokens"] for c in cs),
        }
    return {"summary": out, "cells": cells}


def no_shared_content(args, bench: Bench, home: Path) -> dict:
    """TTFT of prompts that share nothing with the cache (each in a namespace of its own), automatic
    reuse on vs off, alternating which goes first; and the work automatic reuse adds to a
    request's path, measured in-process (keys, lookups)."""
    rows = musique(args.split)
    on, off = [], []
    for r in range(args.pairs):
        ex = rows[args.examples + r % 3]
        docs = [" ".join(c["text"].split()[: args.words]) for c in ex["ctxs"]]
        pair = round_order([("on", "auto"), ("off", "prefix")], r, alternate=True)
        for label, mode in pair:
            # a budget of its own: automatic reuse looks up even where the model's blend is prefix
            got = bench.ask(
                docs,
                ex["question"],
                mode,
                "0.3" if label == "on" else None,
                salt=f"fresh-{label}-{r}-{time.time_ns()}",
            )
            (on if label == "on" else off).append(got["ttft_s"])
    ex = rows[args.examples]
    text = bench.text(
        [" ".join(c["text"].split()[: args.words]) for c in ex["ctxs"]], ex["question"]
    )
    return {
        "ttft_ms_on": [1000 * x for x in on],
        "ttft_ms_off": [1000 * x for x in off],
        "ratio_on_vs_off": statistics.median(on) / statistics.median(off),
        "request_path": request_path_cost(bench.model, home, text, bench.chat),
    }


def request_path_cost(model: str, home: Path, text: str, chat: bool, repeats: int = 20) -> dict:
    """Milliseconds a request spends being keyed (``Keying.sequence``: with automatic reuse, the
    content chunks and their keys) and looked up (``Prefiller.lookup``: with it, one more batched
    lookup) with automatic reuse off and on, in-process on the model's tokenizer and a memory
    tier (medians of ``repeats``)."""
    from kvfuse.blend import BlendOptions
    from kvfuse.config import EngineSettings
    from kvfuse.engine import CacheOptions, Engine, Prompt
    from kvfuse.models import load_model
    from kvfuse.prompts import PromptBuilder
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    loaded = load_model(model, home=home, device="cpu", dtype="auto")
    out = {}
    for auto in ("off", "on"):
        engine = Engine(
            loaded,
            TieredStore(MemoryTier(1 << 30)),
            EngineSettings.of(history=False, blend=BlendOptions(auto=auto, recompute_ratio=0.3)),
        )
        prompts = PromptBuilder.for_model(loaded)
        ids = (
            prompts.encode_chat([{"role": "user", "content": text}])[0]
            if chat
            else prompts.encode_prompt(text)
        )
        keying, lookup = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            reuse = engine.cache.key(Prompt.plain(ids), CacheOptions(), None, 1)
            t1 = time.perf_counter()
            engine.cache.prefiller.lookup(reuse)
            keying.append(t1 - t0)
            lookup.append(time.perf_counter() - t1)
        out[auto] = {
            "keying_ms": 1000 * statistics.median(keying),
            "lookup_ms": 1000 * statistics.median(lookup),
            "content_chunks": len(reuse.keys.content),
            "prompt_tokens": len(ids),
        }
        engine.close()
    out["added_ms"] = sum(out["on"][k] - out["off"][k] for k in ("keying_ms", "lookup_ms"))
    return out


# ------------------------------------------------------------------------------------ quality


def quality(args, bench: Bench) -> dict:
    """Fictional QA sent as plain prompts: full prefill, automatic reuse at each budget and
    documents at the calibrated one (each in a namespace of its own, warmed with the passages in
    another order)."""
    items = fictional_qa.items(args.split, args.items)
    budgets = [b for b in args.quality_budgets.split(",") if b]
    rows: dict[str, list[dict]] = {}
    for n, it in enumerate(items):
        docs = list(it.documents)
        other = docs[2:] + docs[:2]  # the passages seen before, in another order
        full = bench.ask(docs, it.question, "full", max_tokens=20)
        rows.setdefault("full prefill", []).append(_scored(full, it, full))
        for mode, b in [("auto", b) for b in budgets] + [("documents", "auto")]:
            salt = f"q-{mode}-{b}-{it.index}-{time.time_ns()}"
            bench.ask(other, "Which document is the longest?", mode, b, salt=salt, max_tokens=1)
            got = bench.ask(docs, it.question, mode, b, salt=salt, max_tokens=20)
            rows.setdefault(f"{mode} {b}", []).append(_scored(got, it, full))
        if (n + 1) % 5 == 0:
            print(f"  {bench.model}: {n + 1}/{len(items)} items", flush=True)
    full_acc = statistics.mean(r["correct"] for r in rows["full prefill"])
    summary = {
        name: {
            "accuracy": statistics.mean(r["correct"] for r in rs),
            "accuracy_vs_full": statistics.mean(r["correct"] for r in rs) / full_acc
            if full_acc
            else None,
            "agrees_with_full": statistics.mean(r["same"] for r in rs),
            "span_reused_tokens": statistics.mean(r["span_reused_tokens"] or 0 for r in rs),
            "auto_reuse": sorted({r["auto_reuse"] for r in rs}),
        }
        for name, rs in rows.items()
    }
    return {"items": len(items), "split": args.split, "summary": summary, "per_item": rows}


def _scored(got: dict, it, full: dict) -> dict:
    return {
        "index": it.index,
        "kind": it.kind,
        "answer": got["text"],
        "gold": it.answer,
        "correct": correct(got["text"], it.answer),
        "same": got["text"] == full["text"],
        "span_reused_tokens": got["span_reused_tokens"],
        "recomputed_tokens": got["recomputed_tokens"],
        "auto_reuse": got["auto_reuse"],
    }


# ------------------------------------------------------------------------------------ report


def report(result: dict) -> None:
    for m in result["models"]:
        if m.get("speed"):
            report_speed(m, result["split"])
        if m.get("no_shared_content"):
            report_no_shared(m["no_shared_content"])
        if m.get("quality"):
            report_quality(m)


def report_speed(m: dict, split: str) -> None:
    sp = m["speed"]
    print(
        f"\n{m['model']}: MuSiQue {split} split, {m['examples']} examples x {m['runs']} runs, "
        f"10 passages of {m['words']} words (~{sp['summary']['full prefill']['prompt_tokens']:.0f} tokens)"
    )
    keys = ["ttft_ms_median", "speedup_vs_full_prefill", "doc_tokens_found", "doc_tokens_reused"]
    print_table(
        ["configuration", "TTFT ms", "speed-up", "found", "reused", "F1 vs full", "F1 gold"],
        [
            [name, *(s[k] for k in keys), s["f1_vs_full"], s["f1_gold"]]
            for name, s in sp["summary"].items()
        ],
    )


def report_no_shared(ns: dict) -> None:
    rp = ns["request_path"]
    print(
        f"no shared content: TTFT on / off {ns['ratio_on_vs_off']:.3f} (medians of {len(ns['ttft_ms_on'])} "
        f"alternating pairs); in-process, automatic reuse adds {rp['added_ms']:.2f} ms to a request "
        f"of {rp['on']['prompt_tokens']} tokens ({rp['on']['content_chunks']} content chunks: keying "
        f"{rp['off']['keying_ms']:.2f} -> {rp['on']['keying_ms']:.2f} ms, lookup "
        f"{rp['off']['lookup_ms']:.2f} -> {rp['on']['lookup_ms']:.2f} ms)"
    )


def report_quality(m: dict) -> None:
    q = m["quality"]
    print(f"\n{m['model']}: fictional QA {q['split']} split, {q['items']} items, plain prompts")
    print_table(
        ["configuration", "accuracy", "vs full", "same answer", "span reused", "auto_reuse"],
        [
            [
                name,
                s["accuracy"],
                s["accuracy_vs_full"] if s["accuracy_vs_full"] is not None else "-",
                s["agrees_with_full"],
                s["span_reused_tokens"],
                ",".join(s["auto_reuse"]),
            ]
            for name, s in q["summary"].items()
        ],
    )


def plot(result: dict, path: Path) -> None:
    """Per model: median TTFT per configuration (speed-up over the bar), and quality vs full prefill."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    models = [m for m in result["models"] if m.get("speed") or m.get("quality")]
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, m in enumerate(models):
        ax = axes[0][col]
        if m.get("speed"):
            s = m["speed"]["summary"]
            names = list(s)
            ax.bar(
                range(len(names)), [s[k]["ttft_ms_median"] / 1000 for k in names], color="tab:blue"
            )
            for i, k in enumerate(names):
                ax.annotate(
                    f"{s[k]['speedup_vs_full_prefill']:.1f}x",
                    (i, s[k]["ttft_ms_median"] / 1000),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_ylabel("TTFT s (client-side, median)")
            ax.set_title(f"{m['model']}: MuSiQue {result['split']}, passages in a new order")
        ax = axes[1][col]
        if m.get("quality"):
            q = m["quality"]["summary"]
            names = list(q)
            ax.bar(
                range(len(names)), [q[k]["accuracy_vs_full"] or 0 for k in names], color="tab:green"
            )
            ax.axhline(0.95, color="red", linestyle="--", linewidth=0.8)
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_ylabel("accuracy / full prefill's")
            ax.set_title(f"{m['model']}: fictional QA {result['split']}, plain prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def run_model(args, model: str, home: Path) -> dict:
    from kvfuse.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(home / "models" / model)
    out = {"model": model, "examples": args.examples, "runs": args.runs, "words": args.words}
    with tempfile.TemporaryDirectory(prefix="kvfuse-auto-") as tmp:
        bench = Bench(model, home, Path(tmp), args.max_tokens)
        out["startup_s"] = bench.startup_s
        try:
            if args.part in ("speed", "all"):
                out["speed"] = speed(args, bench, tokenizer)
                out["no_shared_content"] = no_shared_content(args, bench, home)
            if args.part in ("quality", "all"):
                out["quality"] = quality(args, bench)
        finally:
            bench.close()
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvfuse.config import default_home

    home = Path(args.home) if args.home else default_home()
    result = {
        "benchmark": "auto_reuse",
        "environment": environment(),
        "split": args.split,
        "load_average": os.getloadavg(),
        "models": [],
    }
    if args.combine:
        for p in args.combine:
            r = json.loads(Path(p).read_text())
            result["models"] += r["models"]
            result.setdefault("runs", []).append(
                {"file": p, "environment": r["environment"], "load_average": r.get("load_average")}
            )
    for model in filter(None, args.models.split(",") if not args.combine else ()):
        result["models"].append(run_model(args, model, home))
    result["load_average_end"] = os.getloadavg()
    report(result)
    out = Path(args.out)
    print(f"wrote {write_json(out, result, add_environment=False, indent=1, default=str)}")
    plot(result, plot_path(out))


if __name__ == "__main__":
    main()
