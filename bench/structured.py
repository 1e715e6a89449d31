"""Grammar engines for structured outputs, compared on kvfuse's own tokenizers and models (issue 38).

llguidance, XGrammar and outlines-core (``bench/lib/grammars.py``: one face, each engine fed the
kvfuse tokenizer through its own vocabulary adapter, the same JSON formatting asked of all three)
on the tokenizers of ``--models`` (default SmolLM2, 49k tokens, byte-level BPE; and Gemma 3, 262k
tokens, SentencePiece with byte fallback), over the cases of ``bench/lib/schemas.py``: a flat
object, nested objects with arrays and enums, a tool-call envelope (``anyOf`` over three tools'
parameters) and ``json_object``. Measured:

- **cold**: in a fresh child process per engine and model (one per round): building the engine's
  vocabulary from the tokenizer, then each case's first compile (compile + a matcher + its first
  mask), and the process's resident memory after each (``VmRSS``, MiB over the tokenizer alone);
- **compile** (warm process, a schema not seen before: each round's schemas carry a new
  ``description``) and **cached** (a matcher from the compiled grammar and its first mask: what
  every request after the first pays behind kvfuse's compiled-grammar cache), per case;
- **per-token mask**: the engine writing the next token's bitmask while the real model generates
  (``--samples`` sampled outputs per case, temperature ``--temperature``), median and p99 over all
  tokens; and kvfuse's part (bitmask -> bool tensor -> logits at -inf), which is the same for all;
- **correctness**: every finished output parsed (``json.loads``) and validated
  (``jsonschema``) against its case, the valid instance of each case accepted token by token;
- **coverage** (first model only): per schema keyword (``PROBES``), whether the engine refuses the
  schema, enforces the keyword (its valid instance accepted, its invalid one rejected) or ignores
  it (accepts the invalid instance).

Rounds are interleaved (every engine once per round, rotated), medians with min and max.

    python bench/structured.py                       # smollm2 and gemma3-270m, 3 rounds
    python bench/structured.py --models smollm2 --rounds 1 --samples 1 --tag quick

Writes ``docs/bench/structured.json`` and ``structured.png`` (``--tag T``: ``structured-T``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import csv, parser
from bench.lib.grammars import ENGINES, Vocab, allowed, only_eos, unpack
from bench.lib.results import output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, median, spread
from bench.lib.schemas import CASES, PROBES, Case
from kvfuse.models import Tokenizer, load_model
from kvfuse.models.registry import pull


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def first_mask_ms(engine, compiled, vocab_size: int) -> float:
    """A matcher from ``compiled`` and its first mask, in milliseconds."""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    t0 = time.perf_counter()
    engine.matcher(compiled).fill(row)
    return (time.perf_counter() - t0) * 1e3


def cold_child(engine_name: str, model: str, home: str) -> dict:
    """In this fresh process: the engine's vocabulary and each case's first compile, timed, and
    the memory they take."""
    tok = Tokenizer(pull(model, Path(home)))
    eos = tuple(json.loads(os.environ.get("BENCH_EOS", "[]"))) or (tok.eos_token_id,)
    vocab = Vocab.of(tok, eos)
    base = rss_mib()
    t0 = time.perf_counter()
    engine = ENGINES[engine_name](vocab)
    out = {"vocab_ms": (time.perf_counter() - t0) * 1e3, "vocab_mib": rss_mib() - base}
    for case in CASES:
        try:
            t0 = time.perf_counter()
            compiled = engine.compile(case.schema)
            first_mask_ms(engine, compiled, vocab.size)
            out[f"cold_ms:{case.name}"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - an engine's refusal is a result
            out[f"cold_ms:{case.name}"] = None
            out[f"error:{case.name}"] = str(e)[:200]
    out["compiled_mib"] = rss_mib() - base - out["vocab_mib"]
    return out


def run_cold(engine_name: str, model: str, home: str, eos: tuple[int, ...]) -> dict:
    env = {**os.environ, "BENCH_EOS": json.dumps(list(eos))}
    cmd = [sys.executable, __file__, "--cold-child", engine_name, model, "--home", home]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"cold child {engine_name}/{model} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def with_round(schema: dict | None, r: int) -> dict | None:
    """``schema`` as a schema no engine has seen: a description naming the round."""
    return None if schema is None else {**schema, "description": f"round {r}"}


def replay(engine, compiled, tok: Tokenizer, case: Case, eos, size: int) -> bool:
    """The case's valid instance (``json.dumps``: the format every engine was given), token by
    token: every token allowed and accepted, and the output complete at its end."""
    m = engine.matcher(compiled)
    row = torch.zeros((size + 31) // 32, dtype=torch.int32)
    for t in tok.encode(json.dumps(case.instance), add_special_tokens=False):
        m.fill(row)
        if not allowed(row, t) or not m.accept(t):
            return False
    m.fill(row)
    return only_eos(row, eos, size)


class Generator:
    """The real model, generating under an engine's masks; the masks timed."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.tok = model.tokenizer
        self.eos = model.eos_token_ids

    @torch.inference_mode()
    def sample(self, engine, compiled, case: Case, seed: int, times: dict) -> dict:
        runner, size = self.model.runner, self.tok.vocab_size
        ids = self.tok.encode_chat([{"role": "user", "content": case.prompt}])
        cache = runner.new_cache(len(ids) + self.args.max_tokens + 1, dtype=torch.float16)
        logits = runner.forward(ids, cache).float()
        g = torch.Generator().manual_seed(seed)
        m, row, out = (
            engine.matcher(compiled),
            torch.zeros((size + 31) // 32, dtype=torch.int32),
            [],
        )
        for _ in range(self.args.max_tokens):
            t0 = time.perf_counter()
            m.fill(row)
            t1 = time.perf_counter()
            ok = unpack(row)[: logits.shape[-1]]
            if ok.shape[0] < logits.shape[-1]:
                ok = torch.cat([ok, ok.new_zeros(logits.shape[-1] - ok.shape[0])])
            masked = logits.masked_fill(~ok, float("-inf"))
            times["fill"].append(t1 - t0)
            times["apply"].append(time.perf_counter() - t1)
            if only_eos(row, self.eos, size):
                return self.verdict(out, case, finished=True)
            probs = torch.softmax(masked / self.args.temperature, dim=-1)
            t = int(torch.multinomial(probs, 1, generator=g))
            if not m.accept(t):
                return {"finished": False, "refused_own_token": True}
            out.append(t)
            logits = runner.forward([t], cache).float()
        return self.verdict(out, case, finished=False)

    def verdict(self, out: list[int], case: Case, finished: bool) -> dict:
        import jsonschema

        text = self.tok.decode(out)
        res = {"finished": finished, "tokens": len(out), "text": text[:400]}
        if not finished:
            return res
        try:
            value = json.loads(text)
            res["parsed"] = True
        except ValueError:
            return {**res, "parsed": False, "valid": False}
        schema = case.schema if case.schema is not None else {"type": "object"}
        res["valid"] = jsonschema.Draft202012Validator(schema).is_valid(value)
        return res


def warm_round(engine, gen: Generator, r: int, args) -> dict:
    """One round of one engine in this process: per case, a new schema's compile, a cached
    matcher, the instance replayed, ``--samples`` generated outputs with their masks timed."""
    size, out = gen.tok.vocab_size, {"cases": {}, "fill": [], "apply": []}
    times = {"fill": out["fill"], "apply": out["apply"]}
    for case in CASES:
        res: dict = {}
        try:
            t0 = time.perf_counter()
            compiled = engine.compile(with_round(case.schema, r))
            res["compile_ms"] = (time.perf_counter() - t0) * 1e3 + first_mask_ms(
                engine, compiled, size
            )
        except Exception as e:  # noqa: BLE001 - an engine's refusal is a result
            out["cases"][case.name] = {"error": str(e)[:200]}
            continue
        res["cached_ms"] = first_mask_ms(engine, compiled, size)
        res["instance_ok"] = replay(engine, compiled, gen.tok, case, gen.eos, size)
        res["samples"] = [
            gen.sample(engine, compiled, case, 1000 * r + s, times) for s in range(args.samples)
        ]
        out["cases"][case.name] = res
        done = sum(bool(x.get("valid")) for x in res["samples"])
        print(f"  {engine.name} {case.name}: {done}/{args.samples} valid", flush=True)
    return out


def coverage(engine, tok: Tokenizer, eos) -> dict[str, str]:
    """Per probe: refused (compile error), enforced, ignored (the forbidden instance accepted)
    or wrong (the allowed instance refused)."""
    size, verdicts = tok.vocab_size, {}
    for p in PROBES:
        try:
            compiled = engine.compile(p.schema)
        except Exception as e:  # noqa: BLE001
            verdicts[p.feature] = "refused: " + str(e).splitlines()[0][:120]
            continue
        ok = replay(engine, compiled, tok, Case("", p.schema, "", {"v": p.valid}), eos, size)
        bad = replay(engine, compiled, tok, Case("", p.schema, "", {"v": p.invalid}), eos, size)
        verdicts[p.feature] = "wrong" if not ok else "ignored" if bad else "enforced"
    return verdicts


def measure_model(name: str, args, with_coverage: bool) -> dict:
    model = load_model(name, home=args.home, device="cpu", dtype="float32")
    gen = Generator(model, args)
    vocab = Vocab.of(model.tokenizer, model.eos_token_ids)
    home = str(args.home or os.environ.get("KVFUSE_HOME") or Path.home() / ".cache/kvfuse")
    engines = {n: ENGINES[n](vocab) for n in args.engines}

    def candidate(n: str):
        def one(r: int) -> dict:
            cold = run_cold(n, name, home, model.eos_token_ids)
            return {"cold": cold, **warm_round(engines[n], gen, r, args)}

        return one

    def progress(r: int, _samples) -> None:
        print(f"{name}: round {r + 1}/{args.rounds}; load {os.getloadavg()[0]:.2f}", flush=True)

    samples = interleaved(
        {n: candidate(n) for n in args.engines}, args.rounds, rotate=True, after_round=progress
    )
    out = {"vocab_size": vocab.size, "eos": list(vocab.eos), "engines": samples}
    if with_coverage:
        out["coverage"] = {n: coverage(e, gen.tok, gen.eos) for n, e in engines.items()}
    return out


def summarize_engine(rounds: list[dict]) -> dict:
    """Medians (min, max) over rounds; mask times pooled over every generated token."""
    fill = [x * 1e6 for r in rounds for x in r["fill"]]
    apply = [x * 1e6 for r in rounds for x in r["apply"]]
    out = {
        "vocab_ms": spread(r["cold"]["vocab_ms"] for r in rounds),
        "vocab_mib": median(r["cold"]["vocab_mib"] for r in rounds),
        "compiled_mib": median(r["cold"]["compiled_mib"] for r in rounds),
        "mask_us": _pcts(fill),
        "apply_us": _pcts(apply),
        "cases": {},
    }
    for case in CASES:
        res = [r["cases"].get(case.name, {}) for r in rounds]
        if any("error" in x for x in res):
            out["cases"][case.name] = {"error": next(x["error"] for x in res if "error" in x)}
            continue
        samples = [s for x in res for s in x["samples"]]
        cold = [r["cold"].get(f"cold_ms:{case.name}") for r in rounds]
        out["cases"][case.name] = {
            "cold_ms": spread(c for c in cold if c is not None) if all(cold) else None,
            "compile_ms": spread(x["compile_ms"] for x in res),
            "cached_ms": spread(x["cached_ms"] for x in res),
            "instance_ok": all(x["instance_ok"] for x in res),
            "outputs": len(samples),
            "finished": sum(bool(s.get("finished")) for s in samples),
            "valid": sum(bool(s.get("valid")) for s in samples),
            "refused_own_token": sum(bool(s.get("refused_own_token")) for s in samples),
        }
    return out


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"median": median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "n": len(xs)}


def parse_args():
    p = parser(
        __doc__,
        ("models", {"default": "smollm2,gemma3-270m"}),
        "home",
        ("rounds", {"default": 3, "help": "interleaved rounds (default 3)"}),
        "tag",
    )
    p.add_argument("--engines", default=",".join(ENGINES), help="engines, comma-separated")
    p.add_argument("--samples", type=int, default=2, help="generated outputs per case and round")
    p.add_argument("--max-tokens", type=int, default=160, help="per generated output")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--cold-child", nargs=2, metavar=("ENGINE", "MODEL"), help=argparse_hidden())
    args = p.parse_args()
    args.models, args.engines = csv(args.models), csv(args.engines)
    return args


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def table(results: dict) -> None:
    rows = []
    for model, res in results.items():
        for engine, s in res["summary"].items():
            for case, c in s["cases"].items():
                if "error" in c:
                    rows.append([model, engine, case, "refused", "", "", "", "", ""])
                    continue
                rows.append(
                    [
                        *(model, engine, case),
                        _ms(c["cold_ms"]),
                        _ms(c["compile_ms"]),
                        _ms(c["cached_ms"]),
                        f"{c['valid']}/{c['finished']}/{c['outputs']}",
                        "yes" if c["instance_ok"] else "NO",
                        f"{s['mask_us']['median']:.0f}/{s['mask_us']['p99']:.0f}",
                    ]
                )
    print_table(
        [
            "model",
            "engine",
            "case",
            "cold ms",
            "compile ms",
            "cached ms",
            "valid/finished/all",
            "instance",
            "mask us p50/p99",
        ],
        rows,
    )


def _ms(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def plot(results: dict, name: str) -> None:
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing: no plot")
        return
    models = list(results)
    fig, axes = plt.subplots(1, 2 * len(models), figsize=(6.5 * len(models), 4), squeeze=False)
    for k, model in enumerate(models):
        summary = results[model]["summary"]
        ax = axes[0][2 * k]
        cases = [c.name for c in CASES]
        width = 0.8 / max(1, len(summary))
        for i, (engine, s) in enumerate(summary.items()):
            ys = [(s["cases"][c].get("cold_ms") or {}).get("median", 0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=engine)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("cold compile + first mask, ms")
        ax.set_title(f"{model}: compile")
        ax.legend(fontsize=8)
        ax = axes[0][2 * k + 1]
        names = list(summary)
        for j, key in enumerate(("median", "p99")):
            ys = [summary[e]["mask_us"].get(key, 0) for e in names]
            ax.bar([i + j * 0.4 for i in range(len(names))], ys, 0.4, label=key)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("per-token mask, us")
        ax.set_title(f"{model}: mask per token")
        ax.legend(fontsize=8)
    fig.tight_layout()
    print(f"plot: {save_figure(fig, name)}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.cold_child:
        home = args.home or os.environ.get("KVFUSE_HOME") or str(Path.home() / ".cache/kvfuse")
        print(json.dumps(cold_child(*args.cold_child, home)))
        return
    results = {}
    for i, model in enumerate(args.models):
        res = measure_model(model, args, with_coverage=i == 0)
        res["summary"] = {e: summarize_engine(rs) for e, rs in res["engines"].items()}
        results[model] = res
    table(results)
    name = output_name("structured", args.tag)
    write_json(name, {"rounds": args.rounds, "samples": args.samples, "results": results})
    plot(results, name)


if __name__ == "__main__":
    main()
