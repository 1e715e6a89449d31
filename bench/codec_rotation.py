"""``bench/codec.py --part rotation``: bytes per token and held-out NLL of int8, fp8, the CacheGen
levels and the Hadamard-rotated levels (``cachegen-rot``), per model.

Data: the LongChat *test* split of the quality part (``cachegen_longchat.jsonl`` lines 20-49),
``--limit`` prompts (default 3), each cut to ``--context`` tokens (head of the conversation, then
the question; measured at 2048, so that one model's run takes minutes on 2 cores). As in the
quality part: a lossless run (raw entries) scores the conversation's last 64 tokens before the
question, teacher-forced after the rest; each encoding's entries (the real codec's bytes, with the
model's per-layer bins) are loaded in place of the raw ones and the same tokens scored again.

- bytes per token: every entry of the prompt (header included) / its tokens; ratio to int8;
- NLL and its relative increase against lossless (target: within 2%), KL(lossless || lossy).

fp8 (e4m3) is a baseline simulated here, not a codec: the int8 codec's layout (one fp32 scale
per (layer, K/V, token), abs-max / 448, then one byte per value) with the values rounded to
``torch.float8_e4m3fn`` instead of int8; its bytes are exactly int8's.

``smallest_within`` picks, per codec family, the smallest encoding within 2% NLL: the level a
model's default would be. Results: ``docs/bench/codec_rotation<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import statistics

import torch

from kvfuse.codecs import get_codec
from kvfuse.codecs.cachegen import K_CAP, LEVELS, LevelBins
from kvfuse.codecs.cachegen_rot import HADAMARD, CacheGenRotCodec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_entry

ENCODINGS = (
    ["int8", "fp8"]
    + [f"cachegen.{lv}" for lv in sorted(LEVELS)]
    + [f"cachegen-rot.{lv}" for lv in sorted(LEVELS)]
)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MAX_NLL_INCREASE = 0.02


def fp8_roundtrip(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` (layers, 2, tokens, heads, head_dim) through e4m3 with one abs-max scale per
    (layer, K/V, token) row, back in its dtype."""
    x = kv.float()
    absmax = x.abs().amax(dim=(3, 4), keepdim=True)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (x / scale).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(kv.dtype)


def family_of(encoding: str) -> str:
    """ "cachegen", "cachegen-rot", "cachegen-cap" (CacheGen with K's outlier channels capped),
    "int8", ...: what ``smallest_within`` chooses among."""
    name = encoding.partition(".")[0]
    return name + "-cap" if encoding.endswith("-cap") else name


def parse_encoding(encoding: str, layer_types):
    """The codec of ``encoding``: ``NAME.LEVEL`` ("int8", "cachegen.2", "cachegen-rot.2"), with
    ``-h`` for the rotation without sign flips ("cachegen-rot.2-h"), ``-cap`` for CacheGen with
    K's outlier channels capped at ``K_CAP`` ("cachegen.2-cap"; without it, as for a model whose
    profile has no cap), or bins probed below the levels, ``NAME.kA-BvC-D`` (K A bins in the
    early layers, B later; V C, D)."""
    if encoding.endswith("-cap"):
        return parse_encoding(encoding.removesuffix("-cap"), layer_types).for_model(
            layer_types, k_cap=K_CAP
        )
    name, _, level = encoding.partition(".")
    level, _, variant = level.partition("-h") if level.endswith("-h") else (level, "", "")
    if level.startswith("k"):
        k, _, v = level[1:].partition("v")
        codec = get_codec(name, 0).for_model(layer_types)
        codec.bins = LevelBins(*map(int, k.split("-")), *map(int, v.split("-")))
        return codec
    codec = get_codec(name, int(level or 0)).for_model(layer_types)
    if encoding.endswith("-h"):
        codec = CacheGenRotCodec(codec.configured_level, codec.boosted, 0, HADAMARD)
    return codec


def encoded(entry, key, encoding: str, layer_types) -> tuple[object, int]:
    """The entry of ``encoding`` (``parse_encoding``; "fp8": simulated) for one raw entry, and
    the bytes it takes (fp8: int8's layout)."""
    chunk, tokens = entry.chunk(), entry.token_ids
    if encoding == "fp8":
        lossy = KVChunk(kv=fp8_roundtrip(chunk.kv), positions=chunk.positions)
        size = len(encode_entry(chunk, key, get_codec("int8"), tokens))
        return encode_entry(lossy, key, get_codec("raw"), tokens), size
    e = encode_entry(chunk, key, parse_encoding(encoding, layer_types), tokens)
    return e, len(e)


def _kl(ref: torch.Tensor, lp: torch.Tensor) -> float:
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def rotation_prompt(m, r: dict, budget: int, encodings: list[str], acc: dict) -> None:
    """One prompt: lossless entries scored, then each encoding's entries in their place."""
    from bench.codec import _nll, _settings, prompt_ids
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    ids, head_len = prompt_ids(m.tokenizer, r["prompt"], budget)
    raw = TieredStore(MemoryTier(1 << 34))
    engine = Engine(m, raw, _settings())
    engine.generate(ids, SamplingParams(max_tokens=1))
    context, cont = ids[: head_len - 64], ids[head_len - 64 : head_len]
    ref = torch.log_softmax(engine.score(context, [cont])[0][:-1].float(), -1)
    acc["lossless"]["nll"].append(_nll(ref, cont))
    acc["lossless"]["kl"].append(0.0)
    entries = {k: raw.memory.get(k) for k in raw.memory.keys_lru()}
    for enc in encodings:
        tier = MemoryTier(1 << 34)
        for key, entry in entries.items():
            e, size = encoded(entry, key, enc, m.config.layer_types)
            tier.put(key, e)
            acc[enc]["bytes"] += size
            acc[enc]["tokens"] += entry.shape[2]
        lossy = Engine(m, TieredStore(tier), _settings())
        lp = torch.log_softmax(lossy.score(context, [cont])[0][:-1].float(), -1)
        acc[enc]["nll"].append(_nll(lp, cont))
        acc[enc]["kl"].append(_kl(ref, lp))
        lossy.close()
    engine.close()


def summarize(acc: dict) -> dict:
    """Per encoding: bytes per token, ratio to int8, NLL, its relative increase, KL."""
    base = statistics.mean(acc["lossless"]["nll"])
    int8 = acc["int8"]["bytes"] / acc["int8"]["tokens"] if "int8" in acc else None
    out = {}
    for enc, v in acc.items():
        bpt = v["bytes"] / v["tokens"] if v.get("tokens") else None
        out[enc] = {
            "bytes_per_token": bpt,
            "ratio_vs_int8": int8 / bpt if bpt and int8 else None,
            "nll": statistics.mean(v["nll"]),
            "nll_relative_increase": statistics.mean(v["nll"]) / base - 1,
            "kl_mean": statistics.mean(v["kl"]),
        }
    return out


def smallest_within(results: dict, family: str, limit: float = MAX_NLL_INCREASE) -> str | None:
    """The encoding of ``family`` ("cachegen", "cachegen-rot") with the fewest bytes per token
    whose NLL is within ``limit`` of lossless; None when no level is."""
    ok = [
        (v["bytes_per_token"], enc)
        for enc, v in results.items()
        if family_of(enc) == family and v["nll_relative_increase"] <= limit
    ]
    return min(ok)[1] if ok else None


def run_rotation(args, checkpoint=None) -> dict:
    from bench.codec import longchat
    from kvfuse.models import load_model

    rows = longchat("test")[: args.limit or 3]
    budget = args.context or 8000
    encodings = args.encodings.split(",") if args.encodings else ENCODINGS
    out = {"split": "test", "prompts": len(rows), "context": budget, "models": {}}
    for name in args.models:
        m = load_model(name)
        acc = {e: {"nll": [], "kl": [], "bytes": 0, "tokens": 0} for e in ["lossless", *encodings]}
        for i, r in enumerate(rows):
            rotation_prompt(m, r, budget, encodings, acc)
            print(f"  {name}: prompt {i + 1}/{len(rows)} done", flush=True)
            res = summarize(acc)
            out["models"][name] = {
                "prompts_done": i + 1,
                "results": res,
                "smallest_within_2pct": {
                    f: smallest_within(res, f) for f in ("cachegen", "cachegen-cap", "cachegen-rot")
                },
            }
            if checkpoint is not None:  # a run stopped for time still reports what it measured
                checkpoint(out)
    return out


def report_rotation(res: dict) -> None:
    from bench.lib.results import print_table

    for name, r in res["models"].items():
        print(
            f"\n{name}: LongChat test, {r['prompts_done']} of {res['prompts']} prompts cut to "
            f"{res['context']} tokens"
        )
        print_table(
            ["encoding", "bytes/token", "x smaller than int8", "NLL", "NLL +%", "KL mean"],
            [
                [
                    e,
                    v["bytes_per_token"] or 0,
                    v["ratio_vs_int8"] or 0,
                    v["nll"],
                    100 * v["nll_relative_increase"],
                    v["kl_mean"],
                ]
                for e, v in r["results"].items()
            ],
        )
        print(f"smallest within 2% NLL: {r['smallest_within_2pct']}")


def plot_rotation(res: dict, path) -> None:
    """KL against lossless by size (x smaller than int8), one panel per model, a line per family
    over its levels (KL: the NLL of a few prompts' 64 tokens is too noisy to draw a curve)."""
    from bench.lib.results import pyplot

    plt = pyplot()
    names = list(res["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        r = res["models"][name]["results"]
        for fam, style in (("cachegen", "o-"), ("cachegen-cap", "^-"), ("cachegen-rot", "s-")):
            pts = sorted(
                (v["ratio_vs_int8"], v["kl_mean"])
                for e, v in r.items()
                if family_of(e) == fam and e.partition(".")[2].removesuffix("-cap").isdigit()
            )
            if pts:
                ax.plot(*zip(*pts), style, label=fam)
        for base in ("int8", "fp8"):
            if base in r:
                ax.plot(1.0, r[base]["kl_mean"], "x", label=base)
        ax.set_yscale("log")
        ax.set_xlabel("x smaller than int8")
        ax.set_ylabel("KL(lossless || encoding)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.suptitle("CacheGen: plain, K capped, rotated (LongChat test)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
