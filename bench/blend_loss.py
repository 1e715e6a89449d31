"""Where blending loses the answer, and the training-free levers against it (issue 41, items 1-2).

On fictional QA items (dev split by default; six passages, the answer's among distractors), at
the model runner's level (no server, no store: documents' KV computed alone behind the model's
document context and moved into place, as the engine does), each configuration builds the KV of
``[prefix][documents]``, then the question and a greedy answer run over it. Against full prefill
of the same ids it reports: answers correct (gold in the answer) and identical to full prefill's,
the mean KL(full || config) along full prefill's answer (teacher-forced), as a fraction of full
reuse's, and the time to the first token (documents' KV in memory) as a fraction of a prefill's.

Configurations (``--parts``):

- ``curve``: full reuse and real blends (``blend_prefill``, HKVD) at 0.15, 0.6 ... 1.0;
- ``oracle``: full reuse with the full prefill's KV copied in for some tokens or layers only (an
  upper bound of recomputing exactly those): the first k tokens of each document, the answer's
  document, the distractors, layers ``[0, L)``, layers ``[L, end)``;
- ``levers``: APE (documents behind the prompt's prefix, T/S swept), anchor blocks (documents
  behind the prefix and a fixed anchor passage, its KV dropped), query-aware selection (``attn``,
  ``attn+hkvd`` half each), layer-split recompute from a stored hidden state.

    python bench/blend_loss.py --model qwen2.5-0.5b --items 12 --parts curve,oracle
    python bench/blend_loss.py --model gemma3-270m --items 12 --parts levers --out /tmp/g
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.blend import open_engine, qa_prompt
from bench.lib.cli import add_common, csv
from bench.lib.paths import OUT
from bench.lib.results import environment, print_table, write_json
from kvfuse.blend import BlendOptions, blend_prefill
from kvfuse.blend import levers as lv
from kvfuse.calibration import fictional_qa
from kvfuse.calibration.measure import correct, kl

# A fixed anchor block (Star Attention): neutral text every document is computed behind.
ANCHOR = (
    "The passages below are independent notes from a reference collection. Each one describes "
    "people, companies or places; read each passage on its own.\n"
)


@dataclass
class Case:
    """One item's prompt, its full-prefill state and answer."""

    ids: list[int]
    prefix: list[int]
    spans: list[tuple[int, int]]
    suffix: list[int]
    full: object  # KVCache of [prefix][documents]
    ref_ids: list[int]
    ref_rows: torch.Tensor
    answer: str
    gold: tuple[int, ...]
    prefill_s: float

    @property
    def s(self) -> int:
        return self.spans[-1][1]


def plain(runner):
    return lambda tokens, cache: runner.forward(tokens, cache, logits="all")


def answer(runner, state, suffix, fwd, max_tokens, tok, ref_ids=None, keep_rows=False):
    """Greedy answer over ``state`` (a copy is used): (ids, text to the first line break, the
    teacher-forced rows along ``ref_ids``). Where greedy agrees with ``ref_ids`` the
    teacher-forced pass stands for the decode; after the first disagreement it decodes."""
    cache = state.fork(state.length + len(suffix) + max_tokens + 1)
    ref = list(ref_ids or [])
    base = state.length + len(suffix)
    rows = fwd(list(suffix) + ref[:-1], cache)[len(suffix) - 1 :]
    out = [int(rows[0].argmax())]
    while len(out) < len(ref) and out[-1] == ref[len(out) - 1]:
        out.append(int(rows[len(out)].argmax()))
    text, decoded = tok.decode(out), [rows[: len(out)]]
    while len(out) < max_tokens and "\n" not in text and out[-1] != tok.eos_token_id:
        cache.truncate(base + len(out) - 1)
        row = fwd([out[-1]], cache)[-1:]
        decoded.append(row)
        out.append(int(row[0].argmax()))
        text = tok.decode(out)
    # keep_rows: the rows along the greedy answer itself (the reference's teacher-forced rows)
    return out, text.split("\n")[0], torch.cat(decoded) if keep_rows else rows[: len(ref)]


def prepare(engine, model: str, it, max_tokens: int) -> Case:
    r, tok = engine.model.runner, engine.model.tokenizer
    prompt = qa_prompt(engine, model, it)
    spans = [(s, s + len(ids)) for s, ids in prompt.documents]
    s = spans[-1][1]
    t0 = time.perf_counter()
    full = r.new_cache(len(prompt) + max_tokens + 2, dtype=engine.kv_dtype)
    r.forward(prompt.ids[:s], full, logits="none")
    r.forward(prompt.ids[s:], full.fork(), logits="last")
    prefill_s = time.perf_counter() - t0
    ids = list(prompt.ids)
    ref_ids, _, rows = answer(r, full, ids[s:], plain(r), max_tokens, tok, keep_rows=True)
    return Case(
        ids, ids[: spans[0][0]], spans, ids[s:], full, ref_ids, rows, it.answer,
        it.gold_documents, prefill_s,
    )  # fmt: skip


def reuse_state(engine, case: Case, context: list[int]):
    """``[prefix][documents]``: the prefix exact, each document computed alone behind ``context``
    (its KV dropped) and moved into place."""
    r = engine.model.runner
    kv = r.new_cache(len(case.ids) + 40, dtype=engine.kv_dtype)
    if case.prefix:
        r.forward(case.prefix, kv, logits="none")
    for a, b in case.spans:
        alone = r.new_cache(dtype=engine.kv_dtype)
        r.forward(context + case.ids[a:b], alone, logits="none")
        chunk = alone.chunk(len(context), len(context) + b - a)
        kv.write(a, chunk.kv, chunk.positions)
        r.move_keys(kv, a, b, a)
    return kv


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def blended(engine, case: Case, base, opts: BlendOptions, selection: str | None = None):
    """A real blend of ``base`` (reused KV) with the suffix: the ``[prefix][documents]`` state it
    leaves and its time (documents' recompute and the suffix's pass: the time to first token)."""
    r, n, s = engine.model.runner, len(case.ids), case.s
    kv = base.fork(n + 40)
    kv.positions[s:n] = torch.arange(s, n)
    kv.length = n
    args = (r, kv, case.ids, case.spans[0][0], s, case.spans, opts)
    seconds = timed(lambda: blend_prefill(*args, selection=selection))
    kv.truncate(s)
    return kv, seconds


def oracle(case: Case, base, slots=None, layers=None):
    """``base`` with full prefill's KV copied in at ``slots`` (default: every document slot) of
    ``layers`` (default: all)."""
    kv = base.fork(len(case.ids) + 40)
    d0, s = case.spans[0][0], case.s
    idx = torch.arange(d0, s) if slots is None else torch.as_tensor(slots, dtype=torch.int64)
    lay = slice(None) if layers is None else slice(*layers)
    kv.kv[lay, :, :, idx] = case.full.kv[lay, :, :, idx]
    return kv


def layer_split(engine, case: Case, base, context: list[int], split: int):
    """Layer-split reuse: cached KV below ``split``, every document token recomputed above it
    from its stored (standalone) hidden state; the state and the recompute time."""
    r = engine.model.runner
    hidden = []
    for a, b in case.spans:  # what the store would hold beside the document's KV
        h = lv.hidden_at(r, context + case.ids[a:b], r.new_cache(dtype=engine.kv_dtype), split)
        hidden.append(h[len(context) :])
    kv = base.fork(len(case.ids) + 40)
    slots = torch.arange(case.spans[0][0], case.s)
    h = torch.cat(hidden)
    return kv, timed(lambda: lv.recompute_above(r, kv, h, slots, split, case.s))


@dataclass
class Config:
    """One configuration: the reused state it starts from (``bos``: the model's document
    context; ``prefix``: behind the prompt's prefix; ``anchor``: behind the prefix and ANCHOR),
    how it turns that into the ``[prefix][documents]`` state (with the time it takes, None for
    an oracle), the fraction of document tokens it recomputes, and APE's (T, S) if any."""

    part: str
    start: str
    build: Callable
    recompute: float | None
    ape: tuple[float, float] | None = None

    @property
    def times_suffix(self) -> bool:
        """Whether ``build``'s time already includes the suffix's pass (a real blend does)."""
        return getattr(self.build, "blend", False)


def _first_k(case: Case, k: int) -> list[int]:
    return [i for a, b in case.spans for i in range(a, min(b, a + k))]


def _docs(case: Case, answer_doc: bool) -> list[int]:
    keep = [j in case.gold for j in range(len(case.spans))]
    return [i for j, (a, b) in enumerate(case.spans) if keep[j] == answer_doc for i in range(a, b)]


def configs(parts: list[str], n_layers: int, ape_t: list[float], ape_s: list[float]) -> dict:
    def blend(ratio, method="hkvd", selection=None):
        opts = BlendOptions(recompute_ratio=ratio, method=method, store_blended=False)

        def build(e, c, base):
            return blended(e, c, base, opts, selection)

        build.blend = True
        return build

    def orc(**kw):
        return lambda e, c, base: (oracle(c, base, **kw), None)

    out = {"full reuse": Config("curve", "bos", lambda e, c, base: (base.fork(), 0.0), 0.0)}
    splits = sorted({max(1, n_layers * f // 8) for f in (2, 4, 6)})
    if "curve" in parts:
        for r in (0.15, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
            out[f"hkvd {r:g}"] = Config("curve", "bos", blend(r), r)
    if "oracle" in parts:
        for k in (1, 4, 16, 32):
            out[f"oracle first {k}"] = Config(
                "oracle",
                "bos",
                lambda e, c, base, k=k: (oracle(c, base, _first_k(c, k)), None),
                None,
            )
        for name, gold in (("answer document", True), ("distractors", False)):
            out[f"oracle {name}"] = Config(
                "oracle", "bos", lambda e, c, b, g=gold: (oracle(c, b, _docs(c, g)), None), None
            )
        for L in sorted({*splits, 1, n_layers - 1}):
            out[f"oracle layers [0,{L})"] = Config("oracle", "bos", orc(layers=(0, L)), None)
            out[f"oracle layers [{L},{n_layers})"] = Config(
                "oracle", "bos", orc(layers=(L, n_layers)), 1 - L / n_layers
            )
    if "levers" in parts:
        _levers(out, blend, splits, n_layers, ape_t, ape_s)
    return out


def _levers(out: dict, blend, splits, n_layers, ape_t, ape_s) -> None:
    def reuse(e, c, base):
        return base.fork(), 0.0

    out["prefix reuse"] = Config("levers", "prefix", reuse, 0.0)
    out["anchor reuse"] = Config("levers", "anchor", reuse, 0.0)
    out["anchor+hkvd 0.15"] = Config("levers", "anchor", blend(0.15), 0.15)
    for t in ape_t:
        for s in ape_s:
            out[f"ape T={t:g} S={s:g}"] = Config("levers", "prefix", reuse, 0.0, (t, s))
    for r in (0.06, 0.15):  # EPIC: each document's first tokens recomputed (round robin)
        out[f"sinks {r:g}"] = Config("levers", "bos", blend(r, "sinks"), r)
    for r in (0.15, 0.3):
        out[f"hkvd {r:g}"] = Config("levers", "bos", blend(r), r)
        out[f"attn {r:g}"] = Config("levers", "bos", blend(r, "attn"), r)
        out[f"attn+hkvd {r:g}"] = Config("levers", "bos", blend(r, "hkvd", "attn+hkvd"), r)
    for sp in splits:
        out[f"layer-split {sp}"] = Config(
            "levers",
            "bos",
            lambda e, c, base, sp=sp: layer_split(e, c, base, _context(e, c, "bos"), sp),
            1 - sp / n_layers,
        )


def _context(engine, case: Case, start: str) -> list[int]:
    if start == "bos":
        opts = BlendOptions(recompute_ratio=0.15, store_blended=False)
        return list(engine.cache.document_context(opts, case.prefix))
    anchor = engine.model.tokenizer.encode(ANCHOR, add_special_tokens=False)
    return case.prefix + (list(anchor) if start == "anchor" else [])


def run_item(engine, model, it, cfgs: dict, max_tokens: int) -> dict[str, dict]:
    r, tok = engine.model.runner, engine.model.tokenizer
    case = prepare(engine, model, it, max_tokens)
    starts = {"bos"} | {c.start for c in cfgs.values()}
    bases = {st: reuse_state(engine, case, _context(engine, case, st)) for st in starts}
    suffix_s = timed(lambda: r.forward(case.suffix, bases["bos"].fork(), logits="last"))
    rows = {"full prefill": {"correct": correct(tok.decode(case.ref_ids), case.answer)}}
    for name, cfg in cfgs.items():
        state, work = cfg.build(engine, case, bases[cfg.start])
        fwd, ttft = plain(r), None if work is None else work + (0 if cfg.times_suffix else suffix_s)
        if cfg.ape is not None:
            ctx = torch.zeros(case.s, dtype=torch.bool)
            ctx[case.spans[0][0] : case.s] = True
            t, s = cfg.ape

            def fwd(tokens, cache, ctx=ctx, t=t, s=s):
                return lv.ape_forward(r, tokens, cache, ctx, t, s)

            ttft = timed(lambda: fwd(case.suffix, state.fork()))
        ids, text, got = answer(r, state, case.suffix, fwd, max_tokens, tok, case.ref_ids)
        print(f"    {name}: {text!r} ({case.answer})", flush=True)
        rows[name] = {
            "correct": correct(text, case.answer),
            "identical": ids == case.ref_ids,
            "kl": kl(case.ref_rows, got),
            "ttft_vs_full": None if ttft is None else ttft / case.prefill_s,
        }
    return rows


def summarize(per_item: list[dict[str, dict]]) -> dict[str, dict]:
    """Per configuration: correct and identical counts, mean KL and its fraction of full
    reuse's, median TTFT ratio."""
    reuse_kl = statistics.mean(r["full reuse"]["kl"] for r in per_item)
    out = {}
    for name in per_item[0]:
        rows = [r[name] for r in per_item]
        ttft = [x["ttft_vs_full"] for x in rows if x.get("ttft_vs_full") is not None]
        kls = [x["kl"] for x in rows if "kl" in x]
        out[name] = {
            "correct": sum(x["correct"] for x in rows),
            "identical": sum(x.get("identical", True) for x in rows),
            "kl": statistics.mean(kls) if kls else 0.0,
            "kl_vs_full_reuse": statistics.mean(kls) / reuse_kl if kls and reuse_kl else 0.0,
            "ttft_vs_full": statistics.median(ttft) if ttft else None,
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-0.5b")
    add_common(p, ("split", {"default": "dev"}))
    p.add_argument("--items", type=int, default=12)
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--parts", default="curve,oracle,levers")
    p.add_argument("--ape-t", default="0.6,0.8,0.9,1.0")
    p.add_argument("--ape-s", default="0.8,0.9,1.0")
    p.add_argument("--only", default="", help="configurations to run (names, ';'-separated)")
    add_common(p, "home")
    add_common(p, ("out", {"default": str(OUT / "blend_loss")}))
    args = p.parse_args(argv)
    from kvfuse.config import default_home

    torch.set_grad_enabled(False)
    engine = open_engine(args.model, Path(args.home) if args.home else default_home())
    n_layers = engine.model.runner.config.num_layers
    floats = [[float(x) for x in csv(v)] for v in (args.ape_t, args.ape_s)]
    cfgs = configs(csv(args.parts), n_layers, *floats)
    if args.only:
        only = {n.strip() for n in args.only.split(";")}  # names hold commas: "[0,12)"
        cfgs = {k: v for k, v in cfgs.items() if k in only or k == "full reuse"}
    items = fictional_qa.items(args.split, args.items, args.documents)
    per_item, t0 = [], time.perf_counter()
    for i, it in enumerate(items):
        per_item.append(run_item(engine, args.model, it, cfgs, args.max_tokens))
        print(f"  {args.model}: {i + 1}/{len(items)} items ({time.perf_counter() - t0:.0f}s)")
        write(args, cfgs, per_item, n_layers)  # after every item: a long run keeps what it measured
    engine.close()


def write(args, cfgs: dict, per_item: list, n_layers: int) -> None:
    summary = summarize(per_item)
    print(f"\n{args.model}: {args.split} split, {len(per_item)} items, {args.documents} documents")
    print_table(
        ["config", "correct", "identical", "KL", "KL/reuse", "TTFT/full"],
        [[k, *x.values()] for k, x in summary.items()],
    )
    rows = {
        k: {**x, "recompute": getattr(cfgs.get(k), "recompute", 1.0)} for k, x in summary.items()
    }
    payload = {
        "benchmark": "blend_loss",
        "environment": environment(),
        "model": args.model,
        "split": args.split,
        "items": len(per_item),
        "documents": args.documents,
        "max_tokens": args.max_tokens,
        "layers": n_layers,
        "ttft_note": "runner level, documents' KV in memory; machine shared: ratios within one run",
        "rows": rows,
        "per_item": per_item,
    }
    print(f"wrote {write_json(Path(args.out), payload, indent=1)}")


if __name__ == "__main__":
    main()
