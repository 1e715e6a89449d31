"""Bandwidth-adaptive KV loading (CacheGen streaming) over real bandwidth traces.

A prompt's context (``--chunks`` chunks of 256 tokens: the head of a LongChat conversation, then
its question) is stored on disk once: raw, and as CacheGen levels 1-4. The disk tier is read
through a ``ThrottledTier`` replaying a row of ``../shared/data/cachegen_bw.jsonl`` over time (each
Gbit/s value holds for ``--period`` seconds from the request's start, about a chunk's transfer
time, so the row spans the SLO as the traces span a context), scaled by ``--scale`` to this machine: on 2 CPU cores a 256-token chunk of
SmolLM2 takes ~0.3-0.5 s to recompute and ~45 ms to decode, where the paper's GPU recomputes a
chunk of a 7B model about four times faster than the link sends it raw; scale 0.01 keeps that
regime (the mean trace value becomes ~5.6 MB/s: a raw chunk ~1 s, a level-2 chunk ~0.17 s).

Policies, each starting with an empty memory tier (nothing prefetched), the same trace row:

- ``adaptive``: kvfuse's loader with ``kv_slo_ms`` = the SLO minus the question's compute time
  (measured), choosing per chunk among raw and levels 1-4, recomputing when nothing fits;
- ``raw`` and ``level-N``: every chunk read at that one encoding (a store whose disk holds only it);
- ``recompute``: no cache; the whole prompt is prefilled.

Reported per policy over all (prompt, trace row) runs: SLO violations (TTFT > ``--slo-ms``),
TTFT p50/p95, quality against the lossless answer (greedy agreement of ``--max-tokens`` tokens,
KL of next-token distributions over the lossless answer, teacher-forced through the same loading
path and trace; raw and recompute are lossless by construction and not scored again), and for
``adaptive`` the chunks per choice. Targets: adaptive has fewer
violations than every fixed level, at quality no worse than the lowest level.

Prompts: LongChat test lines (20-49) from ``--first`` (0-19: dev). The scale and the SLO follow
from the regime argument above, not from measurements on test prompts. Results: ``docs/bench/streaming.json`` + ``streaming.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from bench.lib.cli import add_common
from bench.lib.paths import DATA
from bench.lib.results import plot_path, print_table, write_json
from bench.lib.rounds import interleaved
from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse_testkit.throttled import ThrottledTier, load_trace

LEVELS = (1, 2, 3, 4)
CHUNK = 256
_QUESTION = " USER: Great, this is the end"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(p, "model")
    p.add_argument(
        "--chunks", type=int, default=10, help="context chunks (the traces have 10 values per row)"
    )
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument(
        "--first", type=int, default=20, help="first LongChat line (20-49: test; 0-19: dev)"
    )
    p.add_argument("--trace", default=str(DATA / "cachegen_bw.jsonl"))
    p.add_argument("--rows", type=int, default=10, help="trace rows (one run per row and prompt)")
    p.add_argument(
        "--scale", type=float, default=0.01, help="trace Gbit/s multiplier for this machine"
    )
    p.add_argument("--period", type=float, default=0.2, help="seconds each trace value holds")
    p.add_argument("--slo-ms", type=float, default=2000.0)
    p.add_argument("--max-tokens", type=int, default=16)
    return p.parse_args(argv)


def prompts(tokenizer, first: int, n: int, chunks: int) -> list[list[int]]:
    rows = [
        json.loads(line)
        for line in (DATA / "cachegen_longchat.jsonl").read_text().splitlines()
        if line.strip()
    ]
    out = []
    for r in rows[first : first + n]:
        head_text, _, rest = r["prompt"].rpartition(_QUESTION)
        head = tokenizer.encode(head_text)[: chunks * CHUNK]
        out.append(head + tokenizer.encode(_QUESTION + rest, add_special_tokens=False))
    return out


class Disk:
    """One prompt's entries on disk: ``raw/`` (raw primaries + every level as variants) and
    ``level-N/`` (level N primaries only), written once."""

    def __init__(self, root: Path, model, ids: list[int]):
        self.root = root
        stores = {
            "raw": TieredStore(
                MemoryTier(1 << 34), [DiskTier(root / "raw", 1 << 34)], stream_levels=LEVELS
            )
        }
        for lv in LEVELS:
            disk = DiskTier(root / f"level-{lv}", 1 << 34)
            stores[f"level-{lv}"] = TieredStore(
                MemoryTier(1 << 34), [disk], codecs={disk.name: get_codec("cachegen", lv)}
            )
        for s in stores.values():
            Engine(
                model, s, EngineSettings.of(history=False, async_save=False, prefetch=False)
            ).generate(ids, SamplingParams(max_tokens=1))
            s.close()

    def store(
        self, which: str, trace: list[float], scale: float, period: float = 0.2
    ) -> tuple[TieredStore, ThrottledTier]:
        slow = ThrottledTier(
            DiskTier(self.root / which, 1 << 34), trace, scale=scale, period_s=period
        )
        return TieredStore(
            MemoryTier(1 << 34), [slow], stream_levels=LEVELS if which == "raw" else ()
        ), slow


def kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref.float(), -1), torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


class Prompt:
    """One prompt's reference (a cache-free greedy answer and its logits), its entries on disk,
    and its KV budget (the SLO less the question's own compute)."""

    def __init__(self, args, model, tmp: Path, pi: int, ids: list[int], greedy):
        self.args, self.model, self.ids, self.greedy = args, model, ids, greedy
        self.free = Engine(model, None, EngineSettings.of(history=False))
        self.ref = self.free.generate(ids, greedy)
        self.ref_logits = self.free.score(ids, [self.ref.token_ids])[0][:-1]
        # the question's own compute on top of the cached context: outside the KV budget
        self.disk = Disk(tmp / f"p{pi}", model, ids)
        st, _ = self.disk.store("raw", [1e6], 1.0)
        warm = Engine(
            model, st, EngineSettings.of(history=False, async_save=False, prefetch=False)
        ).generate(ids, greedy)
        suffix_ms = warm.timings.prefill_s * 1000
        st.close()
        self.kv_slo_ms = max(1.0, args.slo_ms - suffix_ms)
        self.estimates = None  # what the adaptive policy's earlier requests measured
        print(
            f"prompt {pi}: {len(ids)} tokens, question compute {suffix_ms:.0f} ms -> kv_slo_ms {self.kv_slo_ms:.0f}",
            flush=True,
        )

    def policy(self, policy: str, trace: list[float], shared: dict) -> tuple:
        """(the result, the logits scored) of one request under ``policy`` with ``trace``."""
        if policy == "recompute":
            return self.free.generate(self.ids, self.greedy), self.ref_logits, {}
        a, extra = self.args, {}
        which = "raw" if policy == "adaptive" else policy
        store, slow = self.disk.store(which, trace, a.scale, a.period)
        engine = Engine(
            self.model, store, EngineSettings.of(history=False, async_save=False, prefetch=False)
        )
        estimates = engine.cache.parts.estimates
        if policy == "adaptive" and "estimates" in shared:
            carry_estimates(shared["estimates"], estimates)  # what earlier requests measured
        cache = CacheOptions(kv_slo_ms=self.kv_slo_ms) if policy == "adaptive" else CacheOptions()
        slow.reset()  # the trace starts with the request
        result = engine.generate(self.ids, self.greedy, cache=cache)
        if policy == "raw":
            logits = self.ref_logits  # lossless entries: the full prefill's numbers (to rounding)
        else:
            store.memory.clear()
            slow.reset()
            logits = engine.score(self.ids, [self.ref.token_ids], cache=cache)[0][:-1]
        if policy == "adaptive":
            shared["estimates"] = estimates
            extra["chunks"] = dict(result.kv_stream.chunks) if result.kv_stream else {}
            extra["kv_load_ms"] = result.kv_stream.load_s * 1000 if result.kv_stream else None
        engine.close()
        store.close()
        return result, logits, extra


def run(args) -> dict:
    from kvfuse.models import load_model

    model = load_model(args.model)
    traces = [load_trace(args.trace, row) for row in range(args.rows)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    policies = ["adaptive", "raw", *[f"level-{lv}" for lv in LEVELS], "recompute"]
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    shared: dict = {}  # the adaptive policy's estimates, carried across requests
    with tempfile.TemporaryDirectory(prefix="kvfuse-stream-") as tmp:
        for pi, ids in enumerate(prompts(model.tokenizer, args.first, args.prompts, args.chunks)):
            pr = Prompt(args, model, Path(tmp), pi, ids, greedy)

            def one(policy: str):
                def request(ri: int) -> dict:
                    r, logits, extra = pr.policy(policy, traces[ri], shared)
                    return {"prompt": pi, "row": ri, **extra} | {
                        "ttft_ms": r.timings.ttft_s * 1000,
                        "violated": r.timings.ttft_s * 1000 > args.slo_ms,
                        "agree": r.token_ids == pr.ref.token_ids,
                        "kl": kl(pr.ref_logits, logits),
                    }

                return request

            def row(ri: int, samples: dict) -> None:
                print(
                    f"  row {ri}: "
                    + "  ".join(f"{p} {samples[p][-1]['ttft_ms']:.0f}ms" for p in policies)
                    + f"  adaptive chunks {samples['adaptive'][-1].get('chunks')}",
                    flush=True,
                )

            # every trace row is a round: each policy once, in this order
            done = interleaved({p: one(p) for p in policies}, len(traces), after_round=row)
            for p in policies:
                runs[p] += done[p]
            pr.free.close()
    summary = {p: policy_summary(p, rs) for p, rs in runs.items()}
    return {
        "model": args.model,
        "chunks": args.chunks,
        "slo_ms": args.slo_ms,
        "scale": args.scale,
        "period_s": args.period,
        "trace": Path(args.trace).name,
        "rows": args.rows,
        "prompts": args.prompts,
        "first_line": args.first,
        "summary": summary,
        "targets": targets(summary, policies),
        "runs": runs,
    }


def policy_summary(p: str, rs: list[dict]) -> dict:
    t = sorted(x["ttft_ms"] for x in rs)
    out = {
        "runs": len(rs),
        "slo_violations": sum(x["violated"] for x in rs),
        "violation_rate": sum(x["violated"] for x in rs) / len(rs),
        "ttft_p50_ms": statistics.median(t),
        "ttft_p95_ms": t[min(len(t) - 1, int(0.95 * len(t)))],
        "answer_agreement": sum(x["agree"] for x in rs) / len(rs),
        "kl_mean": statistics.mean(x["kl"] for x in rs),
    }
    if p == "adaptive":
        chunks: dict[str, int] = {}
        for x in rs:
            for k, v in x.get("chunks", {}).items():
                chunks[k] = chunks.get(k, 0) + v
        out["chunks"] = chunks
    return out


def targets(summary: dict, policies: list[str]) -> dict:
    fixed = [p for p in policies if p != "adaptive"]
    lowest = "level-1"
    return {
        "fewer_violations_than_every_fixed_policy": all(
            summary["adaptive"]["slo_violations"] < summary[p]["slo_violations"]
            for p in fixed
            if p != "recompute"
        ),
        "fewer_violations_than_recompute": summary["adaptive"]["slo_violations"]
        < summary["recompute"]["slo_violations"],
        "quality_no_worse_than_lowest_level": summary["adaptive"]["kl_mean"]
        <= summary[lowest]["kl_mean"],
    }


def report(res: dict) -> None:
    print(
        f"\n{res['model']}, {res['chunks']} chunks, SLO {res['slo_ms']:.0f} ms TTFT, trace {res['trace']} x "
        f"{res['scale']}, {res['prompts']} prompts x {res['rows']} rows"
    )
    rows = [
        [
            p,
            s["slo_violations"],
            f"{100 * s['violation_rate']:.0f}%",
            s["ttft_p50_ms"],
            s["ttft_p95_ms"],
            s["answer_agreement"],
            s["kl_mean"],
        ]
        for p, s in res["summary"].items()
    ]
    print_table(
        [
            "policy",
            "violations",
            "rate",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "agrees w/ lossless",
            "KL mean",
        ],
        rows,
    )
    print("adaptive chunks per choice:", res["summary"]["adaptive"].get("chunks"))
    print("targets:", res["targets"])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    names = list(s)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].bar(
        names,
        [100 * s[p]["violation_rate"] for p in names],
        color=["#c44" if p == "adaptive" else "#48a" for p in names],
    )
    axes[0].set_ylabel(f"% runs with TTFT > {res['slo_ms']:.0f} ms")
    axes[0].set_title("SLO violations")
    axes[0].tick_params(axis="x", rotation=30)
    for p in names:
        axes[1].scatter(s[p]["ttft_p50_ms"], s[p]["kl_mean"] + 1e-6, label=p, s=60)
    axes[1].axvline(res["slo_ms"], color="#999", linestyle="--")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("TTFT p50 (ms)")
    axes[1].set_ylabel("KL vs lossless (mean, log)")
    axes[1].legend(fontsize=8)
    axes[1].set_title("delay vs quality")
    fig.suptitle(f"Bandwidth-adaptive loading, {res['model']}, trace x {res['scale']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    report(res)
    write_json("streaming" if args.first >= 20 else "streaming_dev", res)
    plot(res, plot_path("streaming" if args.first >= 20 else "streaming_dev"))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def carry_estimates(src, dst) -> None:
    """What ``src`` (a ``LoadEstimates``) measured, into ``dst``: each run's engine starts from
    the rates the runs before it measured, as one long-running engine would."""
    dst.bandwidth.update(src.bandwidth)
    dst.bandwidth_avg.update(src.bandwidth_avg)
    dst.bytes_per_value.update(src.bytes_per_value)
    dst.decode_s_per_value.update(src.decode_s_per_value)
    dst.compute_s_per_token = src.compute_s_per_token
