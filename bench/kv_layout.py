"""KV memory layout for batched decoding: one contiguous cache per sequence vs a paged block pool.

What a decode step's attention costs under each layout, for B sequences of L tokens each, with
SmolLM2-135M's shapes (30 layers, 9 query heads, 3 KV heads of 64; fp16 KV, fp32 compute):

- ``contiguous``: kvfuse's layout (``models/cache.py``): each sequence's K/V of a layer is one
  view; attention reads it directly (SDPA converts fp16 -> fp32 as it goes).
- ``paged``: a vLLM / nano-vllm style pool of 16-token blocks shared by every sequence, a block
  table per sequence; in pure PyTorch attention first gathers a sequence's blocks into one tensor
  (``index_select``), every layer of every step. (vLLM's CPU backend has its own C++ paged kernel
  for this; kvfuse has no compiled kernels.)
- ``padded``: one SDPA call for the whole batch over K/V copied into a padded
  ``(B, heads, max L, dim)`` tensor with a length mask (fewer Python calls, one more copy).

It also reports the memory each layout reserves for the same sequences: contiguous caches are
allocated with headroom (``DECODE_HEADROOM``) and grow by reallocation; the pool wastes at most
one partial block per sequence.

Medians of interleaved repetitions, with min and max. Writes ``docs/bench/kv_layout.json`` and
``docs/bench/kv_layout.png``. About a minute (``--quick``: seconds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.cli import parser
from bench.lib.results import environment, output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, spread

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64
BLOCK = 16
HEADROOM = 64  # kvfuse.engine.core.DECODE_HEADROOM


def contiguous_step(q, caches, lengths):
    for layer in range(LAYERS):
        for b, kv in enumerate(caches):
            k, v = kv[layer, 0, :, : lengths[b]], kv[layer, 1, :, : lengths[b]]
            F.scaled_dot_product_attention(
                q[b : b + 1], k.unsqueeze(0).float(), v.unsqueeze(0).float(), enable_gqa=True
            )


def paged_step(q, pool, tables, lengths):
    for layer in range(LAYERS):
        for b, table in enumerate(tables):
            blocks = pool[layer].index_select(1, table)  # (2, n_blocks, kv_heads, BLOCK, dim)
            kv = blocks.permute(0, 2, 1, 3, 4).reshape(2, KV_HEADS, -1, DIM)[:, :, : lengths[b]]
            F.scaled_dot_product_attention(
                q[b : b + 1],
                kv[0].unsqueeze(0).float(),
                kv[1].unsqueeze(0).float(),
                enable_gqa=True,
            )


def padded_step(q, caches, lengths):
    n = max(lengths)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    mask = mask[:, None, None, :]
    for layer in range(LAYERS):
        k = torch.zeros(len(caches), KV_HEADS, n, DIM)
        v = torch.zeros(len(caches), KV_HEADS, n, DIM)
        for b, kv in enumerate(caches):
            k[b, :, : lengths[b]] = kv[layer, 0, :, : lengths[b]]
            v[b, :, : lengths[b]] = kv[layer, 1, :, : lengths[b]]
        F.scaled_dot_product_attention(
            q.unsqueeze(2).squeeze(2), k, v, attn_mask=mask, enable_gqa=True
        )


def case(batch: int, length: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(batch * 7919 + length)
    lengths = [
        max(1, length - (i * length) // (4 * batch)) for i in range(batch)
    ]  # a spread of lengths
    cap = [n + HEADROOM for n in lengths]
    caches = [torch.randn(LAYERS, 2, KV_HEADS, c, DIM, generator=g).half() for c in cap]
    blocks_per = [-(-n // BLOCK) for n in lengths]
    pool = torch.randn(LAYERS, 2, sum(blocks_per), KV_HEADS, BLOCK, DIM, generator=g).half()
    perm = torch.randperm(
        sum(blocks_per), generator=g
    )  # blocks of a sequence scattered in the pool
    tables, at = [], 0
    for n in blocks_per:
        tables.append(perm[at : at + n].clone())
        at += n
    q = torch.randn(batch, HEADS, 1, DIM, generator=g)
    runs = {
        "contiguous": lambda: contiguous_step(q, caches, lengths),
        "paged": lambda: paged_step(q, pool, tables, lengths),
        "padded": lambda: padded_step(q, caches, lengths),
    }
    for fn in runs.values():
        fn()  # warm-up
    times = interleaved({name: _timed(fn) for name, fn in runs.items()}, reps)
    slot = LAYERS * 2 * KV_HEADS * DIM * 2
    live = sum(lengths) * slot
    out = {
        "batch": batch,
        "tokens_per_sequence": length,
        "live_kv_mb": round(live / 2**20, 2),
        "reserved_mb": {
            "contiguous": round(sum(cap) * slot / 2**20, 2),
            "paged": round(sum(blocks_per) * BLOCK * slot / 2**20, 2),
        },
    }
    for name, ts in times.items():
        out[name] = {k: round(v * 1000, 2) for k, v in spread(ts, "_ms").items()}
    out["paged_over_contiguous"] = round(
        out["paged"]["median_ms"] / out["contiguous"]["median_ms"], 2
    )
    out["padded_over_contiguous"] = round(
        out["padded"]["median_ms"] / out["contiguous"]["median_ms"], 2
    )
    return out


def _timed(fn):
    def run(_r: int) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


HEADERS = [
    "B",
    "L",
    "contiguous",
    "paged",
    "padded",
    "paged/contig",
    "padded/contig",
    "reserved MB contig",
    "reserved MB paged",
    "live MB",
]


def row(r: dict) -> list:
    return [
        r["batch"],
        r["tokens_per_sequence"],
        r["contiguous"]["median_ms"],
        r["paged"]["median_ms"],
        r["padded"]["median_ms"],
        r["paged_over_contiguous"],
        r["padded_over_contiguous"],
        r["reserved_mb"]["contiguous"],
        r["reserved_mb"]["paged"],
        r["live_kv_mb"],
    ]


def main() -> None:
    ap = parser(__doc__, "quick", ("threads", {"default": 2}))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 7
    grid = (
        [(1, 512), (16, 512)]
        if args.quick
        else [(1, 512), (4, 512), (16, 256), (16, 512), (16, 1024), (32, 512)]
    )
    with torch.inference_mode():
        results = [case(batch, length, reps) for batch, length in grid]
    print("attention of one decode step, all 30 layers (ms, median of", reps, "interleaved runs)")
    print_table(HEADERS, [row(r) for r in results])
    name = output_name("kv_layout", quick=args.quick)
    meta = {
        "model_shapes": "SmolLM2-135M: 30 layers, 9 heads, 3 KV heads x 64, fp16 KV, fp32 compute",
        "block_tokens": BLOCK,
        "headroom_tokens": HEADROOM,
        "reps": reps,
        "threads": args.threads,
        **environment(),
    }
    write_json(name, {"meta": meta, "results": results}, add_environment=False, indent=1)
    plot(results, name)


def plot(results: list[dict], name: str) -> None:
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"B={r['batch']}\nL={r['tokens_per_sequence']}" for r in results]
    x = range(len(results))
    for i, layout in enumerate(("contiguous", "paged", "padded")):
        ax.bar(
            [j + (i - 1) * 0.27 for j in x],
            [r[layout]["median_ms"] for r in results],
            0.27,
            label=layout,
        )
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("attention ms per decode step (30 layers)")
    ax.set_title("KV layout: per-sequence contiguous vs paged pool (pure PyTorch, CPU)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, name, dpi=120)


if __name__ == "__main__":
    main()
