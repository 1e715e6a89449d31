"""The CacheGen codec: size, entropy bound, throughput and answer quality, per level.

Part ``size`` (default; minutes). Real KV of SmolLM2 and Gemma3 (MuSiQue *dev* documents,
``--tokens`` tokens in 256-token chunks, fp16). Per chunk and encoding: bytes per token for raw
fp16, int8 (kvfuse's per-token abs-max codec, the paper's 8-bit baseline), zstd of the fp16 bytes,
and CacheGen levels 1-4; the ratio to int8. For CacheGen, the coded streams against their bounds:

- ``coder_vs_models``: bytes the rANS streams take / bits the stream models promise (the coder's
  own bound; the target is within 5%);
- ``models_vs_entropy``: bits the models promise / the empirical entropy of each (layer, K/V,
  channel) stream of the chunk (what a per-chunk frequency table would reach, were the table
  free);
- ``entry_vs_entropy``: the whole entry (scales, stream models, headers) / that entropy.

Two design measurements, reported with the sizes:

- ``--part`` size also codes the same symbols with a per-model *profile* (frequency tables from
  the first dev chunks, shipped once) instead of per-chunk models: which is smaller overall;
- token-group deltas (CacheGen's paper: each token minus its group's anchor, groups of 10):
  empirical entropy and squared error at equal bins, against plain per-token quantization.

Encode and decode throughput: MB/s of fp16-equivalent KV (median, min, max of ``--repeats``),
with the worker processes the engine uses (one per core) and in-process.

Part ``quality`` (an hour on 2 cores). LongChat (``cachegen_longchat.jsonl``; lines 0-19 dev,
20-49 test: ``--split``), SmolLM2 (prompts truncated to its 8192-token context: the head of the
conversation is kept up to 8000 tokens minus the question, then the question) and Gemma3 (whole
prompts). For each prompt, a lossless run (raw entries) and one per encoding (int8, CacheGen
levels), the prompt's whole chunks loaded from entries of that encoding:

- first-topic accuracy (``label[0]`` in the answer, normalised) and agreement with the lossless
  answer (greedy, ``--max-tokens``);
- KL(lossless || lossy) of next-token distributions and NLL over a held-out continuation: the
  conversation's last 64 tokens before the question, teacher-forced after the rest;
- relative NLL increase against the lossless run (the "quality within 2%" target).

Part ``fictional``: the fictional-QA generator of the CacheBlend work (``kvfuse/calibration/fictional_qa.py``,
facts no model knows), ``--limit`` items (default 40) of ``--split`` with ``--documents``
documents each (default 12, ~1.5k tokens: 5-6 whole chunks), as plain prompts (documents, then
the question): accuracy per encoding and agreement with the lossless answer. Results:
``codec_fictional.json``.

Part ``allocation`` (dev prompts only: how the levels' bins were chosen). The whole chunks of
``--limit`` LongChat dev prompts are quantized and dequantized with candidate bin allocations
(CacheGen's own table, K or V left raw, K channels equalized per chunk, more bins for K than for
V) and the held-out continuation scored as above; bits per value are the stream models' bound plus
the side information. Results: ``codec_allocation_dev.json``.

Part ``rotation`` (``bench/codec_rotation.py``): int8, fp8, the CacheGen levels and the
Hadamard-rotated ones (``cachegen-rot``), bytes per token and held-out NLL on LongChat test
prompts cut to ``--context`` tokens. Results: ``codec_rotation<tag>.json`` + ``.png``.

Results: ``docs/bench/codec.json`` + ``codec.png`` (size), ``codec_quality.json`` (quality).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np
import torch

from bench.lib.cli import add_common
from bench.lib.data import dev_text_tokens
from bench.lib.paths import DATA
from bench.lib.results import plot_path, print_table, write_json
from kvfuse.codecs import get_codec
from kvfuse.codecs.cachegen import LEVELS, LevelBins
from kvfuse.entropy import layer as coded_layer
from kvfuse.entropy import models as stream_models
from kvfuse.entropy import pool
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_entry

MODELS = ("smollm2", "gemma3-270m")
CHUNK = 256
ENCODINGS = ["int8"] + [f"cachegen.{lv}" for lv in sorted(LEVELS)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--part", choices=("size", "quality", "fictional", "allocation", "rotation"), default="size"
    )
    p.add_argument("--documents", type=int, default=12, help="documents per fictional QA item")
    add_common(p, ("models", {"nargs": "+", "default": list(MODELS)}))
    p.add_argument("--tokens", type=int, default=2048, help="KV tokens per model for the size part")
    add_common(p, "repeats")
    add_common(p, ("split", {"default": "test"}))
    p.add_argument(
        "--limit", type=int, default=0, help="LongChat prompts per model (0: the whole split)"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="prompt budget in tokens, every model (default: SmolLM2 8000, its window being "
        "8192; the others whole prompts)",
    )
    p.add_argument(
        "--allocations",
        choices=sorted(ALLOCATION_SETS),
        default="design",
        help="allocation part: the design rows (how the levels were chosen) or the levels' own "
        "(where each level's loss sits, K channels equalized)",
    )
    p.add_argument(
        "--encodings",
        default="",
        help="quality part: the encodings compared (default int8 and every cachegen level; "
        "cachegen.N-uniform: without the per-model layer bins)",
    )
    add_common(
        p,
        (
            "tag",
            {
                "default": "",
                "help": "suffix of the result file (runs of one model at a time in parallel)",
            },
        ),
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- size


def model_kv(name: str, tokens: int) -> torch.Tensor:
    from kvfuse.models import load_model

    m = load_model(name)
    ids = dev_text_tokens(m.tokenizer, tokens)
    cache = m.runner.new_cache(tokens, dtype=torch.float16)
    with torch.inference_mode():
        m.runner.forward(ids, cache, logits="none")
    return cache.chunk(0, tokens).kv.clone()


def stream_stats(kv: torch.Tensor, level: int, profile: dict | None = None) -> dict:
    """Bits of one chunk's CacheGen symbols: empirical entropy, model bound, and (with
    ``profile``) the cross-entropy under per-model profile tables."""
    L, _, T, H, D = kv.shape
    bins = LEVELS[level]
    out = {"entropy_bits": 0.0, "model_bits": 0.0, "profile_bits": 0.0, "values": 0}
    for i in range(L):
        for part, b in enumerate(bins.of_layer(i, L)):
            sym, _ = coded_layer.quantize(kv[i, part].float().reshape(T, H * D).numpy(), b)
            a = b - 1
            counts = np.stack([np.bincount(s, minlength=a) for s in sym]).astype(np.float64)
            p = counts / T
            with np.errstate(divide="ignore", invalid="ignore"):
                out["entropy_bits"] += float(-(counts * np.where(p > 0, np.log2(p), 0)).sum())
            centre, width = stream_models.fit(sym, a)
            out["model_bits"] += stream_models.ideal_bits(sym, centre, width, a)
            if profile is not None:
                prof = profile[(i, part)]
                out["profile_bits"] += float(-(counts * np.log2(prof)).sum())
            out["values"] += sym.size
    return out


def build_profile(chunks: list[torch.Tensor], level: int) -> dict:
    """Per (layer, K/V, channel) symbol frequencies over ``chunks`` (add-one smoothed)."""
    L = chunks[0].shape[0]
    bins = LEVELS[level]
    prof = {}
    for i in range(L):
        for part, b in enumerate(bins.of_layer(i, L)):
            counts = None
            for kv in chunks:
                T, H, D = kv.shape[2:]
                sym, _ = coded_layer.quantize(kv[i, part].float().reshape(T, H * D).numpy(), b)
                c = np.stack([np.bincount(s, minlength=b - 1) for s in sym]).astype(np.float64)
                counts = c if counts is None else counts + c
            prof[(i, part)] = (counts + 1) / (counts + 1).sum(axis=1, keepdims=True)
    return prof


def delta_experiment(kv: torch.Tensor, group: int = 10) -> dict:
    """Token-group deltas against plain per-token quantization, at 8-64 bins: empirical entropy
    (bits per value) and mean squared error of each; then the bits plain quantization needs for
    each delta setting's error (interpolated in log-log), i.e. the comparison at equal quality."""
    L, _, T, H, D = kv.shape

    def entropy(sym, bins):
        counts = np.stack([np.bincount(s, minlength=bins - 1) for s in sym]).astype(np.float64)
        p = counts / counts.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(-(counts * np.where(p > 0, np.log2(p), 0)).sum())

    anchors = np.arange(T) % group == 0
    curves = {"plain": [], "delta": []}
    for bins in (8, 16, 32, 64):
        acc = {"plain": [0.0, 0.0], "delta": [0.0, 0.0]}  # bits, squared error
        n = 0
        for i in range(L):
            for part in range(2):
                x = kv[i, part].float().reshape(T, H * D).numpy()
                sym, sc = coded_layer.quantize(x, bins)
                acc["plain"][0] += entropy(sym, bins)
                acc["plain"][1] += float(((coded_layer.dequantize(sym, sc, bins) - x) ** 2).sum())
                # anchors quantized as usual; every other token as its difference from its group's
                # (reconstructed) anchor, so errors do not compound
                sa, sca = coded_layer.quantize(x[anchors], bins)
                rec_a = coded_layer.dequantize(sa, sca, bins)
                anchor_of = np.repeat(rec_a, group, axis=0)[:T]
                sd, scd = coded_layer.quantize(x[~anchors] - anchor_of[~anchors], bins)
                acc["delta"][0] += entropy(sa, bins) + entropy(sd, bins)
                rec = np.empty_like(x)
                rec[anchors] = rec_a
                rec[~anchors] = anchor_of[~anchors] + coded_layer.dequantize(sd, scd, bins)
                acc["delta"][1] += float(((rec - x) ** 2).sum())
                n += x.size
        for kind in curves:
            curves[kind].append(
                {"bins": bins, "bits_per_value": acc[kind][0] / n, "mse": acc[kind][1] / n}
            )
    plain = sorted(curves["plain"], key=lambda r: r["mse"])
    lm, lb = np.log([r["mse"] for r in plain]), [r["bits_per_value"] for r in plain]
    for r in curves["delta"]:
        r["plain_bits_at_same_mse"] = float(np.interp(np.log(r["mse"]), lm, lb))
        r["delta_vs_plain"] = r["bits_per_value"] / r["plain_bits_at_same_mse"]
    return curves


def zstd_bytes(kv: torch.Tensor) -> int:
    import zstandard

    return len(
        zstandard.ZstdCompressor(level=3).compress(
            kv.contiguous().view(torch.uint8).numpy().tobytes()
        )
    )


def throughput(kv: torch.Tensor, codec, repeats: int) -> dict:
    chunk = KVChunk(kv=kv, positions=torch.arange(kv.shape[2]))
    enc, dec = [], []
    entry = None
    for _ in range(repeats):
        t = time.perf_counter()
        entry = encode_entry(chunk, "k", codec)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        entry.decode()
        dec.append(time.perf_counter() - t)
    mb = kv.numel() * 2 / 1e6
    return {"encode_mb_s": [mb / s for s in enc], "decode_mb_s": [mb / s for s in dec]}


def _empty_bounds() -> dict:
    keys = ("entropy_bits", "model_bits", "profile_bits", "values", "stream_bytes", "side_bytes")
    return {lv: {k: 0.0 if k.endswith("_bits") else 0 for k in keys} for lv in LEVELS}


def chunk_sizes(chunks: list, shape: tuple) -> tuple[dict, dict]:
    """Bytes of every chunk in each encoding, and per CacheGen level the bounds' ingredients
    (entropy, stream models, profile) over the chunks after the two profiled ones."""
    L, _, _, H, D = shape
    sizes = {"raw_fp16": 0, "zstd_fp16": 0}
    sizes.update({e: 0 for e in ENCODINGS})
    bounds = _empty_bounds()
    profile_chunks = chunks[:2]  # profiled on the first two chunks; measured on the others
    profiles = {lv: build_profile(profile_chunks, lv) for lv in LEVELS}
    for ci, ch in enumerate(chunks):
        sizes["raw_fp16"] += ch.numel() * 2
        sizes["zstd_fp16"] += zstd_bytes(ch)
        positions = torch.arange(ch.shape[2])
        sizes["int8"] += len(
            encode_entry(KVChunk(kv=ch, positions=positions), "k", get_codec("int8"))
        )
        for lv in LEVELS:
            entry = encode_entry(
                KVChunk(kv=ch, positions=positions), "k", get_codec("cachegen", lv)
            )
            sizes[f"cachegen.{lv}"] += len(entry)
            if ci < len(profile_chunks):
                continue
            st = stream_stats(ch, lv, profiles[lv])
            b = bounds[lv]
            for k in ("entropy_bits", "model_bits", "profile_bits", "values"):
                b[k] += st[k]
            T = ch.shape[2]
            per_part_side = 2 * T + 2 * H * D + 4  # scales, stream models, word count
            side = L * (12 + 8 + 2 * per_part_side)
            b["side_bytes"] += side + entry.header_size
            b["stream_bytes"] += len(entry) - side - entry.header_size
    return sizes, bounds


def bound_rows(bounds: dict, shape: tuple, n_chunks: int) -> dict:
    L, _, _, H, D = shape
    out = {}
    for lv, b in bounds.items():
        entropy_b = b["entropy_bits"] / 8
        out[f"cachegen.{lv}"] = {
            "bits_per_value": 8 * (b["stream_bytes"] + b["side_bytes"]) / b["values"],
            "entropy_bits_per_value": b["entropy_bits"] / b["values"],
            "coder_vs_models": b["stream_bytes"] / (b["model_bits"] / 8),
            "models_vs_entropy": b["model_bits"] / b["entropy_bits"],
            "entry_vs_entropy": (b["stream_bytes"] + b["side_bytes"]) / entropy_b,
            "per_chunk_models_bytes": b["stream_bytes"] + b["side_bytes"],
            # the same entries without their per-chunk stream models (2 bytes per stream), the
            # symbols coded with the profile's tables instead (the profile itself not counted)
            "profile_bytes": b["profile_bits"] / 8
            + b["side_bytes"]
            - 4 * L * H * D * (n_chunks - 2),
        }
    return out


def default_level_throughput(chunk, repeats: int) -> dict:
    """The default level's encode/decode MB/s with the shared worker pool and in-process."""
    codec = get_codec("cachegen")
    tp_pool = throughput(chunk, codec, repeats)
    pool.set_shared_pool(0)
    tp_one = throughput(chunk, codec, repeats)
    pool.set_shared_pool(pool.default_size())
    return {"workers": pool.default_size(), "pool": tp_pool, "in_process": tp_one}


def run_size(args) -> dict:
    res = {"chunk_tokens": CHUNK, "models": {}}
    for name in args.models:
        kv = model_kv(name, args.tokens)
        chunks = [kv[:, :, a : a + CHUNK].contiguous() for a in range(0, kv.shape[2], CHUNK)]
        L, _, _, H, D = kv.shape
        sizes, bounds = chunk_sizes(chunks, kv.shape)
        tokens = sum(c.shape[2] for c in chunks)
        rows = bound_rows(bounds, kv.shape, len(chunks))
        tp = default_level_throughput(chunks[0], args.repeats)
        res["models"][name] = {
            "layers": L,
            "kv_heads": H,
            "head_dim": D,
            "tokens": tokens,
            "values_per_token": L * 2 * H * D,
            "bytes_per_token": {k: v / tokens for k, v in sizes.items()},
            "ratio_vs_int8": {k: sizes["int8"] / v for k, v in sizes.items()},
            "ratio_vs_fp16": {k: sizes["raw_fp16"] / v for k, v in sizes.items()},
            "bounds": rows,
            "throughput_default_level": tp,
            "deltas": delta_experiment(kv[:, :, :1024]),
        }
    return res


def report_size(res: dict) -> None:
    for name, r in res["models"].items():
        print(
            f"\n{name}: {r['layers']} layers x {r['kv_heads']} KV heads x {r['head_dim']}, {r['tokens']} tokens "
            f"in {res['chunk_tokens']}-token chunks"
        )
        rows = [
            [k, r["bytes_per_token"][k], r["ratio_vs_fp16"][k], r["ratio_vs_int8"][k]]
            for k in ["raw_fp16", "zstd_fp16", *ENCODINGS]
        ]
        print_table(["encoding", "bytes/token", "x smaller than fp16", "x smaller than int8"], rows)
        keys = ["bits_per_value", "entropy_bits_per_value", "coder_vs_models"]
        keys += ["models_vs_entropy", "entry_vs_entropy"]
        print_table(
            ["level", "bits/value", "entropy bits/value", "coder/models", "models/entropy"]
            + ["entry/entropy", "profile/per-chunk"],
            [
                [k, *(b[x] for x in keys), b["profile_bytes"] / b["per_chunk_models_bytes"]]
                for k, b in r["bounds"].items()
            ],
        )
        report_throughput(r["throughput_default_level"])
        print(
            "  token-group deltas (anchor + deltas, groups of 10) vs plain per-token quantization:"
        )
        keys = ["bins", "bits_per_value", "mse", "plain_bits_at_same_mse", "delta_vs_plain"]
        print_table(
            ["bins", "delta bits/value", "delta MSE", "plain bits at that MSE", "delta / plain"],
            [[d[k] for k in keys] for d in r["deltas"]["delta"]],
        )


def report_throughput(tp: dict) -> None:
    for kind in ("pool", "in_process"):
        e, d = tp[kind]["encode_mb_s"], tp[kind]["decode_mb_s"]
        print(
            f"  {kind:<10} encode {statistics.median(e):6.0f} MB/s (min {min(e):.0f}, max {max(e):.0f})  "
            f"decode {statistics.median(d):6.0f} MB/s (min {min(d):.0f}, max {max(d):.0f})  "
            f"[fp16-equivalent, {tp['workers']} workers]"
            if kind == "pool"
            else f"  {kind:<10} encode {statistics.median(e):6.0f} MB/s  decode {statistics.median(d):6.0f} MB/s"
        )


def plot_size(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        r = res["models"][name]
        keys = ["raw_fp16", "zstd_fp16", *ENCODINGS]
        vals = [r["bytes_per_token"][k] / 1024 for k in keys]
        ax.bar(
            range(len(keys)), vals, color=["#999", "#bbb", "#d88", "#48a", "#37a", "#269", "#158"]
        )
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
        ax.set_ylabel("KiB per token")
        ax.set_title(f"{name}: KV size per encoding")
        for i, k in enumerate(keys):
            ax.text(
                i, vals[i], f"{r['ratio_vs_int8'][k]:.2f}x", ha="center", va="bottom", fontsize=8
            )
    fig.suptitle("CacheGen codec: bytes per token (labels: x smaller than int8)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------- quality


def context_budget(args, name: str) -> int | None:
    """A model's prompt budget: ``--context`` if given, else SmolLM2's window (8000 of 8192)."""
    return args.context or (8000 if name == "smollm2" else None)


def longchat(split: str) -> list[dict]:
    rows = [
        json.loads(line)
        for line in (DATA / "cachegen_longchat.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return rows[:20] if split == "dev" else rows[20:]


_QUESTION = " USER: Great, this is the end"


def prompt_ids(tokenizer, text: str, budget: int | None) -> tuple[list[int], int]:
    """The prompt's ids (head of the conversation, then the question) and where the question starts."""
    head_text, _, rest = text.rpartition(_QUESTION)
    head = tokenizer.encode(head_text)
    tail = tokenizer.encode(_QUESTION + rest, add_special_tokens=False)
    if budget is not None and len(head) + len(tail) > budget:
        head = head[: budget - len(tail)]
    return head + tail, len(head)


def normalise(s: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", s.lower()).strip()


def reencoded_store(raw_tier, encoding: str, layer_types=()):
    """The raw entries re-encoded as ``encoding`` ("int8", "cachegen.2": as the engine writes it for
    this model, with its per-layer bins; "cachegen.2-uniform": every layer by the level's table)."""
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    name, _, level = encoding.partition(".")
    level, _, variant = level.partition("-")
    codec = get_codec(name, int(level or 0))
    if variant != "uniform":
        codec = codec.for_model(layer_types)
    tier = MemoryTier(1 << 34)
    for key in raw_tier.keys_lru():
        entry = raw_tier.get(key)
        tier.put(key, encode_entry(entry.chunk(), key, codec))
    return TieredStore(tier)


def _settings():
    from kvfuse.config import EngineSettings

    return EngineSettings.of(history=False, async_save=False, prefetch=False)


def _nll(logp, cont: list[int]) -> float:
    return float(-logp[torch.arange(len(cont)), torch.tensor(cont)].mean())


def quality_prompt(m, r: dict, budget, encodings: list[str], greedy, per: dict) -> tuple:
    """One LongChat prompt: lossless entries answered and scored, then each encoding's entries
    (re-encoded from them) against them; ``per`` collects. Returns (lossless text, truncated)."""
    from kvfuse.engine import Engine
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    ids, head_len = prompt_ids(m.tokenizer, r["prompt"], budget)
    truncated = budget is not None and head_len + (len(ids) - head_len) >= budget
    raw = TieredStore(MemoryTier(1 << 34))
    engine = Engine(m, raw, _settings())
    lossless = engine.generate(ids, greedy)
    context, cont = ids[: head_len - 64], ids[head_len - 64 : head_len]
    ref_logp = torch.log_softmax(engine.score(context, [cont])[0][:-1].float(), -1)
    answers = {"lossless": lossless.text}
    per["lossless"]["nll"].append(_nll(ref_logp, cont))
    per["lossless"]["kl"].append(0.0)
    for enc in encodings:
        store = reencoded_store(raw.memory, enc, m.config.layer_types)
        lossy_engine = Engine(m, store, _settings())
        res = lossy_engine.generate(ids, greedy)
        assert res.cached_tokens >= (len(ids) // 256) * 256 - 256, "the lossy entries were not used"
        answers[enc] = res.text
        logp = torch.log_softmax(lossy_engine.score(context, [cont])[0][:-1].float(), -1)
        per[enc]["kl"].append(float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()))
        per[enc]["nll"].append(_nll(logp, cont))
        per[enc]["agree"] += res.text == lossless.text
        lossy_engine.close()
        store.close()
    gold = normalise(r["label"][0])
    for enc, text in answers.items():
        per[enc]["correct"] += gold in normalise(text)
    per["lossless"]["agree"] += 1
    engine.close()
    return lossless.text, truncated


def quality_results(per: dict, n: int) -> dict:
    base_nll = statistics.mean(per["lossless"]["nll"])
    return {
        e: {
            "accuracy": v["correct"] / n,
            "answer_agreement": v["agree"] / n,
            "kl_mean": statistics.mean(v["kl"]),
            "kl_median": statistics.median(v["kl"]),
            "nll": statistics.mean(v["nll"]),
            "nll_relative_increase": statistics.mean(v["nll"]) / base_nll - 1,
        }
        for e, v in per.items()
    }


def run_quality(args, checkpoint=None) -> dict:
    from kvfuse.generation import SamplingParams
    from kvfuse.models import load_model

    rows = longchat(args.split)
    if args.limit:
        rows = rows[: args.limit]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    out = {"split": args.split, "prompts": len(rows), "max_tokens": args.max_tokens, "models": {}}
    for name in args.models:
        m = load_model(name)
        budget = context_budget(args, name)
        encodings = args.encodings.split(",") if args.encodings else ENCODINGS
        per = {e: {"correct": 0, "agree": 0, "kl": [], "nll": []} for e in ["lossless", *encodings]}
        truncated = 0
        t0 = time.perf_counter()
        for i, r in enumerate(rows):
            text, cut = quality_prompt(m, r, budget, encodings, greedy, per)
            truncated += cut
            print(
                f"  {name} {i + 1}/{len(rows)} ({time.perf_counter() - t0:.0f}s) lossless={text!r}",
                flush=True,
            )
            out["models"][name] = {
                "context_budget": budget,
                "prompts_truncated": truncated,
                "prompts_done": i + 1,
                "results": quality_results(per, i + 1),
            }
            if (
                checkpoint is not None
            ):  # a long run can be stopped and still report what it measured
                checkpoint(out)
    return out


def run_fictional(args) -> dict:
    from bench.blend import correct, qa_prompt
    from kvfuse.calibration import fictional_qa
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.models import load_model
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    data = fictional_qa.items(args.split, args.limit or 40, args.documents)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop=("\n",))
    out = {"split": args.split, "items": len(data), "documents": args.documents, "models": {}}
    for name in args.models:
        m = load_model(name)
        per = {e: {"correct": 0, "agree": 0} for e in ["lossless", *ENCODINGS]}
        tokens = []
        for it in data:
            raw = TieredStore(MemoryTier(1 << 34))
            engine = Engine(
                m, raw, EngineSettings.of(history=False, async_save=False, prefetch=False)
            )
            ids = qa_prompt(
                engine, name, it
            ).ids  # a plain prompt: the documents are prefix chunks here
            tokens.append(len(ids))
            lossless = engine.generate(ids, greedy)
            per["lossless"]["correct"] += correct(lossless.text, it.answer)
            per["lossless"]["agree"] += 1
            for enc in ENCODINGS:
                store = reencoded_store(raw.memory, enc, m.config.layer_types)
                lossy = Engine(
                    m, store, EngineSettings.of(history=False, async_save=False, prefetch=False)
                )
                r = lossy.generate(ids, greedy)
                per[enc]["correct"] += correct(r.text, it.answer)
                per[enc]["agree"] += r.token_ids == lossless.token_ids
                lossy.close()
            engine.close()
        n = len(data)
        out["models"][name] = {
            "prompt_tokens_mean": statistics.mean(tokens),
            "results": {
                e: {"accuracy": v["correct"] / n, "answer_agreement": v["agree"] / n}
                for e, v in per.items()
            },
        }
        print(f"  {name}: done", flush=True)
    return out


def report_fictional(res: dict) -> None:
    for name, r in res["models"].items():
        print(
            f"\n{name}: fictional QA {res['split']}, {res['items']} items x {res['documents']} documents "
            f"(~{r['prompt_tokens_mean']:.0f} tokens)"
        )
        print_table(
            ["encoding", "accuracy", "agrees w/ lossless"],
            [[e, v["accuracy"], v["answer_agreement"]] for e, v in r["results"].items()],
        )


def channel_scales(x: np.ndarray, cap: float | None, typical: bool = False) -> np.ndarray:
    """Per-channel divisors of a ``(tokens, channels)`` part: each channel's abs-max over the
    tokens (``cap`` None: every channel equalized), or only the channels above ``cap`` times the
    median channel's abs-max, brought down to that (the others left as they are). ``typical``:
    a channel's size is its median magnitude over the tokens instead of its abs-max (a channel
    large in one token only, an attention sink's, is then not divided for all the others)."""
    m = np.median(np.abs(x), 0) if typical else np.abs(x).max(0)
    if cap is None:
        return np.where(m > 0, m, 1).astype(np.float32)
    ceiling = cap * float(np.median(m))
    return np.where(m > ceiling, m / max(ceiling, 1e-30), 1).astype(np.float32)


def split_quantize(x: np.ndarray, b: int, cap: float) -> tuple[np.ndarray, float]:
    """``x`` ``(tokens, channels)`` with its outlier channels (abs-max over the tokens above
    ``cap`` x the median channel's) quantized as a group of their own, each group with its own
    per-token scale (no value's step is larger than in one row): values and bits (the stream
    models' bound, both groups' scales, one bit per channel for the mask)."""
    m = np.abs(x).max(0)
    outlier = m > cap * np.quantile(m, 0.5, method="lower")
    rec, bits = np.empty_like(x), float(x.shape[1])
    for group in (outlier, ~outlier):
        if not group.any():
            continue
        sym, sc = coded_layer.quantize(x[:, group], b)
        centre, width = stream_models.fit(sym, b - 1)
        bits += stream_models.ideal_bits(sym, centre, width, b - 1) + 16 * x.shape[0]
        bits += 16 * int(group.sum())
        rec[:, group] = coded_layer.dequantize(sym, sc, b)
    return rec, bits


def simulate(
    kv: torch.Tensor,
    bins: LevelBins,
    k_raw: bool = False,
    v_raw: bool = False,
    k_equalized: bool = False,
    k_cap: float | None = None,
    k_typical: bool = False,
    k_split: float | None = None,
) -> tuple[torch.Tensor, float, int]:
    """``kv`` quantized and dequantized with ``bins`` (the codec's quantizer), the bits its stream
    models promise plus side information, and the number of values. ``k_equalized``: each K
    channel divided by its abs-max over the chunk first (and multiplied back); with ``k_cap``
    only the channels above ``k_cap`` x the median channel's abs-max (``channel_scales``)."""
    L, _, T, H, D = kv.shape
    out, bits, n = kv.clone().float(), 0.0, 0
    for i in range(L):
        for part, b in enumerate(bins.of_layer(i, L)):
            n += T * H * D
            if (part == 0 and k_raw) or (part == 1 and v_raw):
                bits += 16 * T * H * D
                continue
            x = kv[i, part].float().reshape(T, H * D).numpy()
            if part == 0 and k_split:
                rec, b_bits = split_quantize(x, b, k_split)
                bits += b_bits
                out[i, part] = torch.from_numpy(rec).view(T, H, D)
                continue
            eq = k_equalized and part == 0
            cs = channel_scales(x, k_cap, k_typical) if eq else None
            sym, sc = coded_layer.quantize(x / cs if eq else x, b)
            centre, width = stream_models.fit(sym, b - 1)
            bits += (
                stream_models.ideal_bits(sym, centre, width, b - 1)
                + 16 * T
                + 16 * H * D
                + (16 * H * D if eq else 0)
            )
            rec = coded_layer.dequantize(sym, sc, b)
            out[i, part] = torch.from_numpy(rec * cs if eq else rec).view(T, H, D)
    return out.to(kv.dtype), bits, n


ALLOCATIONS = {
    # name: (bins, options)
    "cachegen-table-2 (K,V 32->16)": (LevelBins(32, 16, 32, 16), {}),
    "  same, K raw": (LevelBins(32, 16, 32, 16), {"k_raw": True}),
    "  same, V raw": (LevelBins(32, 16, 32, 16), {"v_raw": True}),
    "  same, K channels equalized": (LevelBins(32, 16, 32, 16), {"k_equalized": True}),
    "K 32->16, V 16->8": (LevelBins(32, 16, 16, 8), {}),
    "K 32, V 16->8": (LevelBins(32, 32, 16, 8), {}),
    "K 64->16, V 16->8": (LevelBins(64, 16, 16, 8), {}),
    "K 64->32, V 16->8 (level 2)": (LevelBins(64, 32, 16, 8), {}),
    "cachegen-table-3 (K,V 64->32)": (LevelBins(64, 32, 64, 32), {}),
}
# --allocations levels: kvfuse's levels as they are, then where each level's loss sits (K or V)
# and whether equalizing K's channels (their abs-max over the chunk divided out before the
# per-token quantization) removes it: a model whose keys carry a few large channels (Qwen2's
# k_proj biases) spends a token's whole scale on them
LEVEL_ALLOCATIONS = {
    **{f"level {lv}": (LEVELS[lv], {}) for lv in (1, 2, 3)},
    **{
        f"level {lv}, K channels equalized": (LEVELS[lv], {"k_equalized": True}) for lv in (1, 2, 3)
    },
    **{
        f"level {lv}, K channels over {cap:g}x the median capped": (
            LEVELS[lv],
            {"k_equalized": True, "k_cap": cap},
        )
        for lv in (1, 2)
        for cap in (2.0, 4.0)
    },
    **{
        f"level {lv}, K channels over {cap:g}x the median capped, by typical size": (
            LEVELS[lv],
            {"k_equalized": True, "k_cap": cap, "k_typical": True},
        )
        for lv in (1, 2, 3)
        for cap in (4.0,)
    },
    **{
        f"level {lv}, K's outlier channels (over 4x) a group of their own": (
            LEVELS[lv],
            {"k_split": 4.0},
        )
        for lv in (1, 2, 3)
    },
    "level 2, K raw": (LEVELS[2], {"k_raw": True}),
    "level 2, V raw": (LEVELS[2], {"v_raw": True}),
}
ALLOCATION_SETS = {"design": ALLOCATIONS, "levels": LEVEL_ALLOCATIONS}


def allocation_prompt(m, r: dict, budget, acc: dict, allocations: dict) -> None:
    """One prompt: the lossless entries scored, then each bin allocation's simulated entries."""
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
    for a, (bins, opts) in allocations.items():
        tier = MemoryTier(1 << 34)
        for key, entry in entries.items():
            chunk = entry.chunk()
            lossy, bits, n = simulate(chunk.kv, bins, **opts)
            acc[a]["bits"] += bits
            acc[a]["values"] += n
            lossy_chunk = KVChunk(kv=lossy, positions=chunk.positions)
            tier.put(key, encode_entry(lossy_chunk, key, get_codec("raw"), entry.token_ids))
        lossy_engine = Engine(m, TieredStore(tier), _settings())
        lp = torch.log_softmax(lossy_engine.score(context, [cont])[0][:-1].float(), -1)
        # an entry the engine could not use is removed from its tier: none may have been
        if len(list(tier.keys_lru())) != len(entries):
            raise RuntimeError(f"{a}: the simulated entries were not used (see the log above)")
        acc[a]["nll"].append(_nll(lp, cont))
        acc[a]["kl"].append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
        lossy_engine.close()
    engine.close()


def run_allocation(args) -> dict:
    from kvfuse.models import load_model

    rows = longchat("dev")[: args.limit or 3]
    out = {"split": "dev", "prompts": len(rows), "models": {}}
    for name in args.models:
        m = load_model(name)
        budget = context_budget(args, name)
        allocations = ALLOCATION_SETS[args.allocations]
        acc = {
            a: {"nll": [], "kl": [], "bits": 0.0, "values": 0} for a in ["lossless", *allocations]
        }
        for r in rows:
            allocation_prompt(m, r, budget, acc, allocations)
            print(f"  {name}: prompt done", flush=True)
        base = statistics.mean(acc["lossless"]["nll"])
        out["models"][name] = {
            a: {
                "bits_per_value": v["bits"] / v["values"] if v["values"] else 16.0,
                "nll": statistics.mean(v["nll"]),
                "nll_relative_increase": statistics.mean(v["nll"]) / base - 1,
                "kl_mean": statistics.mean(v["kl"]),
            }
            for a, v in acc.items()
        }
    return out


def report_allocation(res: dict) -> None:
    for name, r in res["models"].items():
        print(f"\n{name}: LongChat dev, {res['prompts']} prompts (bin allocations, simulated)")
        print_table(
            ["allocation", "bits/value", "NLL", "NLL +%", "KL mean"],
            [
                [a, v["bits_per_value"], v["nll"], 100 * v["nll_relative_increase"], v["kl_mean"]]
                for a, v in r.items()
            ],
        )


def report_quality(res: dict) -> None:
    for name, r in res["models"].items():
        print(
            f"\n{name}: LongChat {res['split']} ({r['prompts_done']} of {res['prompts']} prompts; context budget "
            f"{r['context_budget'] or 'none'}, {r['prompts_truncated']} truncated)"
        )
        rows = [
            [
                e,
                v["accuracy"],
                v["answer_agreement"],
                v["kl_mean"],
                v["nll"],
                100 * v["nll_relative_increase"],
            ]
            for e, v in r["results"].items()
        ]
        print_table(
            ["encoding", "first-topic acc", "agrees w/ lossless", "KL mean", "NLL", "NLL +%"], rows
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part == "size":
        res = run_size(args)
        report_size(res)
        write_json("codec", res)
        plot_size(res, plot_path("codec"))
    elif args.part == "fictional":
        res = run_fictional(args)
        report_fictional(res)
        write_json(
            ("codec_fictional" if args.split == "test" else "codec_fictional_dev") + args.tag, res
        )
    elif args.part == "rotation":
        from bench import codec_rotation

        name = "codec_rotation" + args.tag
        res = codec_rotation.run_rotation(
            args, checkpoint=lambda partial: write_json(name, partial)
        )
        codec_rotation.report_rotation(res)
        write_json(name, res)
        codec_rotation.plot_rotation(res, plot_path("codec_rotation" + args.tag))
    elif args.part == "allocation":
        res = run_allocation(args)
        report_allocation(res)
        write_json("codec_allocation_dev" + args.tag, res)
    else:
        name = ("codec_quality" if args.split == "test" else "codec_quality_dev") + args.tag
        res = run_quality(args, checkpoint=lambda partial: write_json(name, partial))
        report_quality(res)
        write_json(name, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
