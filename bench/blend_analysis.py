"""Why blending loses quality on small models: where cached document KV deviates from a prefill.

On fictional QA dev items (``kvfuse/calibration/fictional_qa.py``), for each model, this compares the KV of the
documents as a blend starts (each computed alone behind BOS, keys moved into place) with the KV a
full prefill of the same prompt computes, and reports:

- the relative deviation ``|KV_reuse - KV_prefill| / |KV_prefill|`` of K and V per layer
  (how fast the missing cross-document attention builds up with depth);
- the deviation by a token's place in its document (first tokens vs the rest);
- how well the check-layer signals (V deviation at layers 1-3, the question's attention) find the
  tokens that deviate most in the deeper layers (recall of the true top 15%);
- how sparse the deviation is: the share of the deep layers' squared V deviation held by the 15%
  of tokens that deviate most (15% if every token deviates alike; CacheBlend's premise is that a
  few tokens hold most of it).

    python bench/blend_analysis.py --items 10        # dev split; writes docs/bench/blend_analysis.json
    python bench/blend_analysis.py --split test --models smollm2,gemma3-270m,qwen2.5-0.5b,qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.blend import open_engine, qa_prompt
from bench.lib.cli import add_common
from bench.lib.paths import OUT
from bench.lib.results import environment, print_table, write_json
from kvfuse.blend import select as sel
from kvfuse.blend.blender import _attention_mass
from kvfuse.calibration import fictional_qa


def kv_caches(engine, prompt, context_mode: str = "bos"):
    """(the prompt's prefill KV, the KV a blend starts from, the document spans, the suffix start)."""
    r, dtype = engine.model.runner, engine.kv_dtype
    n = len(prompt)
    full = r.new_cache(n, dtype=dtype)
    r.forward(prompt.ids, full, logits="none")
    reuse = r.new_cache(n, dtype=dtype)
    prefix = list(prompt.prefix)
    if prefix:
        r.forward(prefix, reuse, logits="none")
    from kvfuse.blend import BlendOptions

    blend = BlendOptions(recompute_ratio=0.15, document_context=context_mode)
    context = list(engine.cache.document_context(blend, prompt.prefix))
    spans = []
    for start, ids in prompt.documents:
        alone = r.new_cache(dtype=dtype)
        r.forward(context + list(ids), alone, logits="none")
        chunk = alone.chunk(len(context), len(context) + len(ids))
        reuse.write(start, chunk.kv, chunk.positions)
        r.move_keys(reuse, start, start + len(ids), start)
        spans.append((start, start + len(ids)))
    return full, reuse, spans, spans[-1][1]


def analyse(engine, model: str, items: list, context_mode: str = "bos") -> dict:
    r = engine.model.runner
    L = r.config.num_layers
    per_layer = {"k": [[] for _ in range(L)], "v": [[] for _ in range(L)]}
    by_place = {"first 4 tokens": [], "rest": []}
    share = []
    recall = {f"V deviation at layer {c}": [] for c in (1, 2, 3)}
    recall["question attention at layer 1"] = []
    for it in items:
        prompt = qa_prompt(engine, model, it)
        full, reuse, spans, s = kv_caches(engine, prompt, context_mode)
        d0, n = spans[0][0], len(prompt)
        doc = slice(d0, s)
        dev = {}
        for which, name in ((0, "k"), (1, "v")):
            a, b = reuse.kv[:, which, :, doc].float(), full.kv[:, which, :, doc].float()
            err = (a - b).norm(dim=(1, 3)) / b.norm(dim=(1, 3)).clamp_min(1e-6)  # (layers, tokens)
            dev[name] = err
            for layer in range(L):
                per_layer[name][layer].append(float(err[layer].mean()))
        deep = dev["v"][L // 2 :].mean(dim=0)  # what the deeper layers get wrong, per token
        first = torch.zeros(s - d0, dtype=torch.bool)
        for a, b in spans:
            first[a - d0 : min(b, a + 4) - d0] = True
        by_place["first 4 tokens"].append(float(deep[first].mean()))
        by_place["rest"].append(float(deep[~first].mean()))
        k = sel.budget(s - d0, 0.15)
        truth = set(sel.top_k(deep, k).tolist())
        sq = dev["v"][L // 2 :].pow(2).mean(dim=0)
        share.append(float(sq[sel.top_k(deep, k)].sum() / sq.sum().clamp_min(1e-12)))
        for c in (1, 2, 3):
            if c < L:
                got = set(sel.top_k(dev["v"][c], k).tolist())
                recall[f"V deviation at layer {c}"].append(len(got & truth) / k)
        # the question's attention at layer 1 over the prefill KV (what attn and hkvd-attn weigh by)
        h = r.embed(torch.tensor(prompt.ids[s:n]))
        h = r.layer(0, h, full, torch.arange(s, n), kv_len=n)
        q, _, _ = r.project(1, h, full.positions[s:n])
        mass = _attention_mass(r, 1, q, torch.arange(s, n), full, n, torch.arange(d0, s))
        recall["question attention at layer 1"].append(
            len(set(sel.top_k(mass, k).tolist()) & truth) / k
        )
    return {
        "model": model,
        "items": len(items),
        "document_context": context_mode,
        "relative_deviation_by_layer": {
            name: [statistics.mean(x) for x in v] for name, v in per_layer.items()
        },
        "deep_v_deviation_by_place": {k: statistics.mean(v) for k, v in by_place.items()},
        "recall_of_the_top_15_percent": {k: statistics.mean(v) for k, v in recall.items() if v},
        "deviation_share_of_the_top_15_percent": statistics.mean(share),
        "mean_deep_v_deviation": statistics.mean(
            statistics.mean(x) for x in per_layer["v"][L // 2 :]
        ),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=10)
    add_common(p, ("models", {"default": "smollm2,gemma3-270m,qwen2.5-0.5b,qwen2.5-1.5b"}))
    add_common(p, "split")
    p.add_argument(
        "--contexts", default="bos", help="document contexts compared (bos, eos, prefix, none)"
    )
    add_common(p, "home")
    add_common(p, ("out", {"default": str(OUT / "blend_analysis.json")}))
    args = p.parse_args(argv)
    from kvfuse.config import default_home

    home = Path(args.home) if args.home else default_home()
    items = fictional_qa.items(args.split, args.items)
    results = []
    for model in args.models.split(","):
        engine = open_engine(model, home)
        for context in args.contexts.split(","):
            res = analyse(engine, model, items, context)
            results.append(res)
            report(res, args)
        engine.close()
    payload = {
        "benchmark": "blend_analysis",
        "environment": environment(),
        "split": args.split,
        "results": results,
    }
    print(f"wrote {write_json(Path(args.out), payload, indent=1)}")


def report(res: dict, args) -> None:
    model = res["model"]
    print(
        f"\n{model}: relative deviation of the reused documents' KV from a prefill, by layer "
        f"({args.split} split, {args.items} items, documents behind {res['document_context']})"
    )
    rows = [
        [layer, k, v]
        for layer, (k, v) in enumerate(
            zip(res["relative_deviation_by_layer"]["k"], res["relative_deviation_by_layer"]["v"])
        )
    ]
    print_table(["layer", "K", "V"], rows)
    print("deep-layer V deviation by place in the document:", res["deep_v_deviation_by_place"])
    print(
        "recall of the tokens that deviate most in the deep layers (top 15%):",
        res["recall_of_the_top_15_percent"],
    )
    print(
        f"share of the deep squared V deviation held by the top 15% of tokens: "
        f"{res['deviation_share_of_the_top_15_percent']:.2f} (mean deep V deviation "
        f"{res['mean_deep_v_deviation']:.2f})"
    )


if __name__ == "__main__":
    main()
