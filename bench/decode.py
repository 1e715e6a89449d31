"""Single-stream greedy decode speed: kvfuse fp32 vs kvfuse int8 weights vs transformers vs llama.cpp,
against the weight-streaming bound, with int8's agreement with fp32.

Speed. One prompt (the first user message of the ShareGPT dev file, chat-formatted), then
``--tokens`` greedy tokens, end-of-sequence ignored; tokens/s counts the steps after the first
token (the prefill's). Engines, all on ``--threads`` CPU threads, runs interleaved (each round runs
every engine once) so that drift in machine speed hits all alike; medians with min and max:

- kvfuse fp32 / int8 / int8-1pass: ``Engine.generate`` without a cache store (KV float16, the
  engine's default); int8 is ``weights: int8`` (split activations), int8-1pass the same int8
  weights with activations rounded once to 8 bits (not a setting: the trade-off it avoids);
- transformers: ``generate(do_sample=False, use_cache=True)`` on the same weights folder, fp32;
- llama.cpp (llama-cpp-python, in a child process under the interpreter of
  bench/setup_llamacpp.sh): the model's own GGUF (SmolLM2: Q4_1 with a Q8_0 embedding, the file
  kvfuse's weights come from), and the same tensors written as F32 (exactly kvfuse's fp32
  weights) and as Q8_0 (the counterpart of int8) by bench/gguf_variants.py.

The bound: weight bytes a decode step reads (every projection once, the embedding once when it is
also the output projection) / memory read bandwidth measured here (a streaming sum over 512 MiB
on the same threads). Copy bandwidth (bytes copied per second) is reported beside it.

Agreement (int8 vs fp32, kvfuse's runner, fp32 KV): on the first user messages of
``sharegpt_multiturn_dev.jsonl`` (a dev file), fp32 answers greedily (up to ``--agree-tokens``,
stopping at end-of-sequence); int8 is fed the same tokens (teacher forcing, one decode step at a
time) and compared step by step: cosine of the logits, max-abs difference, KL(fp32 || int8),
whether the greedy token is the same; then int8 answers on its own and the first step where it
departs from fp32 is recorded. For scale, the same for fp32 weights with the engine's default fp16
KV (a perturbation kvfuse already ships).

    python bench/decode.py                  # full: 128 tokens x 5 rounds, 16 agreement prompts (~7 min)
    python bench/decode.py --quick          # smoke: 32 tokens x 2 rounds, 4 prompts
    python bench/decode.py --llama-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import DATA, REPO, median, plot_path, print_table, write_json

BASELINE_TOK_S = 10.9  # the measurement of kvfuse fp32 (SmolLM2, this machine)
DEFAULT_LLAMA_VENV = REPO / ".baselines/llama-venv/bin/python"


# ------------------------------------------------------------------------------------- inputs


def sharegpt_first_messages(n: int) -> list[str]:
    """The first user message of each of the first ``n`` conversations that have a non-empty one."""
    out = []
    with open(DATA / "sharegpt_multiturn_dev.jsonl") as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            if msgs and msgs[0]["role"] == "user" and msgs[0]["content"].strip():
                out.append(msgs[0]["content"])
            if len(out) == n:
                break
    return out


def chat_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """``text`` as a user turn of the chat template, its content cut to fit ``max_tokens``."""
    content = text
    ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    while len(ids) > max_tokens:
        keep = tokenizer.encode(content, add_special_tokens=False)
        content = tokenizer.decode(keep[: max(1, len(keep) - (len(ids) - max_tokens) - 1)])
        ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    return ids


# ------------------------------------------------------------------------------ machine load


class OtherLoad:
    """CPU time that other processes used while this benchmark ran: the machine's busy time
    (``/proc/stat``) minus this process's and its children's (the llama.cpp worker). Linux only;
    ``None`` elsewhere."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")
        self.pids: list[int] = []

    def _machine(self) -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return (sum(fields[:3]) + sum(fields[5:8])) / self.tick  # user nice system, irq softirq steal

    def _ours(self) -> float:
        t = os.times()
        total = t.user + t.system
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self.tick
            except OSError:
                pass
        return total

    def mark(self):
        try:
            return time.perf_counter(), self._machine(), self._ours()
        except OSError:
            return None

    @staticmethod
    def since(start, end) -> dict | None:
        """Other processes' CPU seconds between two marks, and as a fraction of one core."""
        if start is None or end is None:
            return None
        wall = end[0] - start[0]
        other = max(0.0, (end[1] - start[1]) - (end[2] - start[2]))
        return {"wall_s": wall, "other_cpu_s": other, "other_cores": other / wall if wall > 0 else 0.0}


# ---------------------------------------------------------------------------------- bandwidth


def memory_bandwidth(mib: int = 512, reps: int = 7) -> dict:
    """Read bandwidth (a streaming sum) and copy bandwidth (bytes copied per second), in GB/s."""
    a = torch.ones(mib * (1 << 20) // 4)
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    reads, copies = [], []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t)
    del a, b
    gc.collect()
    return {"buffer_mib": mib, "read_GBps": nbytes / median(reads) / 1e9, "copy_GBps": nbytes / median(copies) / 1e9,
            "read_GBps_max": nbytes / min(reads) / 1e9}


def kvfuse_weight_bytes(model) -> int:
    from kvfuse.models.quant import weight_bytes

    parts = weight_bytes(model.runner.weights)
    return parts["layers"] + parts["lm_head"] + parts["final_norm"]


# ------------------------------------------------------------------------------------ engines


def kvfuse_timer(model):
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams

    engine = Engine(model, None, EngineSettings.of(history=False, async_save=False))

    def run(ids: list[int], tokens: int) -> dict:
        r = engine.generate(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
        return {"tok_s": r.timings.decode_tokens_per_s(len(r.token_ids)), "ids": r.token_ids,
                "prefill_s": r.timings.prefill_s}

    return run, engine


def transformers_timer(folder: Path):
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) or 0

    class Clock(LogitsProcessor):
        """Called once per generated token, right after its forward pass: the step times."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run(ids: list[int], tokens: int) -> dict:
        clock = Clock()
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, use_cache=True, logits_processor=LogitsProcessorList([clock]),
                              pad_token_id=pad, top_p=None, top_k=None,
                              temperature=None)
        steps = len(clock.times) - 1
        return {"tok_s": steps / (clock.times[-1] - clock.times[0]), "ids": out[0, len(ids):].tolist()}

    return run, hf


class LlamaWorker:
    """bench/llamacpp_worker.py in a child process, under an interpreter that has llama_cpp."""

    def __init__(self, python: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, str(REPO / "bench" / "llamacpp_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict = {}

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (see its stderr above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker: {reply['error']}")
        return reply

    def load(self, name: str, path: Path, threads: int, n_ctx: int) -> None:
        self.info = self.call(cmd="load", name=name, path=str(path), threads=threads, n_ctx=n_ctx)

    def timer(self, name: str):
        return lambda ids, tokens: self.call(cmd="decode", name=name, ids=ids, tokens=tokens)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def find_llama_python(explicit: str | None) -> str | None:
    """An interpreter that imports llama_cpp: ``explicit``, this one, or .baselines/llama-venv's."""
    if explicit is None and importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    python = explicit or (str(DEFAULT_LLAMA_VENV) if DEFAULT_LLAMA_VENV.is_file() else None)
    if python is None:
        return None
    ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not ok:
        print(f"  llama.cpp: {python} cannot import llama_cpp", flush=True)
    return python if ok else None


def gguf_files(name: str, home: Path, precisions: list[str]) -> dict[str, Path]:
    """The model's own GGUF, and the same tensors at ``precisions`` (written once under the home)."""
    from gguf_variants import requantize

    from kvfuse.models import registry

    model = registry.builtin(name)
    source = model.locate(model, home)
    out = {"gguf " + source.stem.rsplit(".", 1)[-1]: source}
    for p in precisions:
        dst = home / "bench" / "gguf" / f"{source.stem}.{p}.gguf"
        if not dst.is_file():
            print(f"  writing {dst.name} from {source.name}", flush=True)
            requantize(source, dst, p)
        out[f"gguf {p.upper()}"] = dst
    return out


# ---------------------------------------------------------------------------------- agreement


@torch.inference_mode()
def agreement(fp32, variants: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per variant (``name -> (runner, KV dtype or None for the compute dtype)``): teacher-forced
    logits agreement along fp32's greedy answers (fp32 KV), and where the variant's own greedy
    answer first departs from fp32's."""
    eos = set(fp32.eos_token_ids)
    steps: dict[str, list[dict]] = {k: [] for k in variants}
    free: dict[str, list[int | None]] = {k: [] for k in variants}
    lengths = []
    for ids in prompts:
        runner = fp32.runner
        cache = runner.new_cache(len(ids) + max_tokens + 1)
        logits = runner.forward(ids, cache)
        ref_logits, ref_tokens = [], []
        while len(ref_tokens) < max_tokens:
            ref_logits.append(logits)
            ref_tokens.append(int(logits.argmax()))
            if ref_tokens[-1] in eos:
                break
            logits = runner.forward([ref_tokens[-1]], cache)
        lengths.append(len(ref_tokens))
        for name, (v, kv_dtype) in variants.items():
            cache = v.new_cache(len(ids) + max_tokens + 1, dtype=kv_dtype)
            logits = v.forward(ids, cache)
            for i, ref in enumerate(ref_logits):
                lp, lq = F.log_softmax(ref, -1), F.log_softmax(logits, -1)
                steps[name].append({
                    "cos": float(F.cosine_similarity(logits, ref, dim=0)),
                    "max_abs": float((logits - ref).abs().max()),
                    "kl": float((lp.exp() * (lp - lq)).sum()),
                    "same": int(logits.argmax()) == ref_tokens[i],
                })
                if i + 1 < len(ref_logits):
                    logits = v.forward([ref_tokens[i]], cache)
            # free-running
            cache = v.new_cache(len(ids) + max_tokens + 1, dtype=kv_dtype)
            logits = v.forward(ids, cache)
            first = None
            for i, t in enumerate(ref_tokens):
                mine = int(logits.argmax())
                if mine != t:
                    first = i
                    break
                if i + 1 < len(ref_tokens):
                    logits = v.forward([mine], cache)
            free[name].append(first)
    out = {}
    for name in variants:
        s = steps[name]
        firsts = free[name]
        diverged = [f for f in firsts if f is not None]
        out[name] = {
            "steps": len(s),
            "mean_cosine": sum(x["cos"] for x in s) / len(s),
            "min_cosine": min(x["cos"] for x in s),
            "mean_max_abs_diff": sum(x["max_abs"] for x in s) / len(s),
            "mean_kl": sum(x["kl"] for x in s) / len(s),
            "greedy_agreement": sum(x["same"] for x in s) / len(s),
            "identical_answers": sum(f is None for f in firsts) / len(firsts),
            "first_divergence": firsts,
            "median_first_divergence": median([f if f is not None else n for f, n in zip(firsts, lengths)]),
            "diverged_prompts": len(diverged),
        }
    return {"prompts": len(prompts), "answer_tokens": lengths, "variants": out}


# --------------------------------------------------------------------------------------- main


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    names = list(engines)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2.2, 1.2]})
    xs = range(len(names))
    med = [engines[n]["median_tok_s"] for n in names]
    lo = [engines[n]["median_tok_s"] - engines[n]["min_tok_s"] for n in names]
    hi = [engines[n]["max_tok_s"] - engines[n]["median_tok_s"] for n in names]
    colors = ["tab:blue" if n.startswith("kvfuse") else "tab:gray" if n == "transformers" else "tab:orange" for n in names]
    ax.bar(xs, med, yerr=[lo, hi], color=colors, capsize=4)
    ax.plot(xs, [engines[n]["bound_tok_s"] for n in names], "k_", markersize=22, mew=2, label="weight-streaming bound")
    for x, n in zip(xs, names):
        ax.text(x + 0.05, engines[n]["max_tok_s"] * 1.03, f"{engines[n]['median_tok_s']:.1f}", ha="left", va="bottom",
                fontsize=8)
    ax.axhline(2 * BASELINE_TOK_S, color="tab:green", ls="--", lw=1, label=f"target 2 x {BASELINE_TOK_S}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_yscale("log")
    ax.set_title(f"{result['model']}: single-stream greedy decode, {result['threads']} CPU threads")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    ag = result["agreement"]["variants"]
    vnames = list(ag)
    width = 0.38
    ax2.bar([i - width / 2 for i in range(len(vnames))], [ag[v]["greedy_agreement"] for v in vnames], width,
            label="greedy token = fp32's (teacher forced)")
    ax2.bar([i + width / 2 for i in range(len(vnames))], [ag[v]["identical_answers"] for v in vnames], width,
            label="whole answer = fp32's")
    for i, v in enumerate(vnames):
        ax2.text(i - width / 2, ag[v]["greedy_agreement"], f"{ag[v]['greedy_agreement']:.3f}", ha="center",
                 va="bottom", fontsize=8)
        ax2.text(i + width / 2, ag[v]["identical_answers"], f"{ag[v]['identical_answers']:.2f}", ha="center",
                 va="bottom", fontsize=8)
    ax2.set_xticks(range(len(vnames)))
    ax2.set_xticklabels(vnames, fontsize=8)
    ax2.set_ylim(0, 1.3)
    ax2.set_title(f"vs fp32, {result['agreement']['prompts']} ShareGPT dev prompts", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center")
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="built-in model (smollm2, gemma3-270m)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per timed run")
    ap.add_argument("--runs", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="the timed prompt, at most this long")
    ap.add_argument("--agree-prompts", type=int, default=16)
    ap.add_argument("--agree-tokens", type=int, default=48, help="answer tokens compared per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default="f32,q8_0", help="extra GGUF precisions for llama.cpp ('' for none)")
    ap.add_argument("--llama-python", help="interpreter with llama_cpp (default: this one, else .baselines/llama-venv)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--home", help="kvfuse home (default: $KVFUSE_HOME or ~/.cache/kvfuse)")
    ap.add_argument("--tag", default="", help="suffix of the result files (decode<tag>.json/.png)")
    ap.add_argument("--quick", action="store_true", help="32 tokens, 2 rounds, 4 agreement prompts of 24 tokens")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.runs, args.agree_prompts, args.agree_tokens = 32, 2, 4, 24
    torch.set_num_threads(args.threads)
    from kvfuse.models import default_home, load_model
    from kvfuse.models.quant import quantize_weights
    from kvfuse.models.transformer import Transformer

    home = Path(args.home) if args.home else default_home()
    load_before = os.getloadavg()
    t_start = time.time()
    print(f"decode benchmark: {args.model}, {args.tokens} tokens x {args.runs} interleaved rounds, "
          f"{args.threads} threads; data: sharegpt_multiturn_dev.jsonl (dev); load average {load_before[0]:.2f}",
          flush=True)

    other = OtherLoad()
    fp32 = load_model(args.model, home=home, device="cpu", dtype="float32")
    int8 = load_model(args.model, home=home, device="cpu", dtype="float32", weights="int8")
    one_pass = Transformer(fp32.config, quantize_weights(fp32.runner.weights, split=False), fp32.runner.device,
                           torch.float32)
    int8_1pass = type(int8)(int8.name, int8.folder, one_pass, int8.tokenizer, int8.fingerprint + "-1pass", "int8")
    texts = sharegpt_first_messages(max(args.agree_prompts, 1))
    prompt = chat_ids(fp32.tokenizer, texts[0], args.prompt_tokens)

    bandwidth = memory_bandwidth()
    print(f"  memory: read {bandwidth['read_GBps']:.1f} GB/s, copy {bandwidth['copy_GBps']:.1f} GB/s", flush=True)

    timers, weight_bytes, closers = {}, {}, []
    for name, model in (("kvfuse fp32", fp32), ("kvfuse int8", int8), ("kvfuse int8-1pass", int8_1pass)):
        run, engine = kvfuse_timer(model)
        timers[name], weight_bytes[name] = run, kvfuse_weight_bytes(model)
        closers.append(engine.close)
    if not args.no_transformers:
        timers["transformers"], _hf = transformers_timer(fp32.folder)
        weight_bytes["transformers"] = weight_bytes["kvfuse fp32"]
    llama_python = find_llama_python(args.llama_python)
    llama_info = None
    if llama_python is None:
        print("  llama.cpp: skipped (llama-cpp-python not found: run `bash bench/setup_llamacpp.sh`, "
              "or pass --llama-python)", flush=True)
    else:
        from gguf_variants import tensor_bytes

        worker = LlamaWorker(llama_python)
        other.pids.append(worker.proc.pid)
        closers.append(worker.close)
        for label, path in gguf_files(args.model, home, [p for p in args.gguf.split(",") if p]).items():
            name = f"llama.cpp {label}"
            worker.load(name, path, args.threads, len(prompt) + args.tokens + 16)
            timers[name] = worker.timer(name)
            weight_bytes[name] = sum(tensor_bytes(path).values())
        llama_info = {"python": llama_python, "version": worker.info.get("version"),
                      "system_info": worker.info.get("system_info")}
        print(f"  llama.cpp: llama-cpp-python {llama_info['version']} via {llama_python}", flush=True)

    for fn in timers.values():  # warm-up: kernel selection, allocator growth, page faults
        fn(prompt, 8)
    samples: dict[str, list[float]] = {k: [] for k in timers}
    generated: dict[str, list[int]] = {}
    rounds_load = []
    for r in range(args.runs):
        start = other.mark()
        for name, fn in timers.items():
            out = fn(prompt, args.tokens)
            samples[name].append(out["tok_s"])
            generated.setdefault(name, out["ids"])
            gc.collect()
        rounds_load.append(OtherLoad.since(start, other.mark()))
        busy = "" if rounds_load[-1] is None else f"; other processes: {rounds_load[-1]['other_cores']:.2f} cores"
        print(f"  round {r + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()) + busy,
              flush=True)
    for close in closers:
        close()

    ref_ids = generated["kvfuse fp32"]
    engines = {}
    for name, s in samples.items():
        wb = weight_bytes[name]
        engines[name] = {
            "tok_s": s, "median_tok_s": median(s), "min_tok_s": min(s), "max_tok_s": max(s),
            "weight_bytes_per_token": wb, "bound_tok_s": bandwidth["read_GBps"] * 1e9 / wb,
            "fraction_of_bound": median(s) / (bandwidth["read_GBps"] * 1e9 / wb),
            "first_divergence_from_kvfuse_fp32": first_divergence(generated[name], ref_ids),
        }

    print(f"  agreement: {args.agree_prompts} prompts, up to {args.agree_tokens} answer tokens each", flush=True)
    prompts = [chat_ids(fp32.tokenizer, t, 256) for t in texts[: args.agree_prompts]]
    # fp32 weights with the engine's fp16 KV: a perturbation kvfuse already ships, for scale
    agree = agreement(fp32, {"int8": (int8.runner, None), "int8-1pass": (one_pass, None),
                             "fp32, fp16 KV": (fp32.runner, torch.float16)}, prompts, args.agree_tokens)

    # prefill cost of int8 (split activations double the rows of a prefill's products)
    long_ids = chat_ids(fp32.tokenizer, " ".join(texts), 512)
    prefill = {}
    for name, model in (("kvfuse fp32", fp32), ("kvfuse int8", int8)):
        ts = []
        for _ in range(3):
            cache = model.runner.new_cache(len(long_ids), dtype=torch.float16)
            t = time.perf_counter()
            model.runner.forward(long_ids, cache)
            ts.append(time.perf_counter() - t)
        prefill[name] = {"tokens": len(long_ids), "median_s": median(ts)}

    load_after = os.getloadavg()
    base = engines["kvfuse fp32"]["median_tok_s"]
    i8 = engines["kvfuse int8"]["median_tok_s"]
    targets = {
        "int8_vs_issue_baseline": i8 / BASELINE_TOK_S,
        "int8_vs_fp32_this_run": i8 / base,
        "int8_at_least_2x_issue_baseline": i8 >= 2 * BASELINE_TOK_S,
    }
    own = next((n for n in engines if n.startswith("llama.cpp gguf ") and n.split()[-1] not in ("F32", "Q8_0", "F16")),
               None)
    if own:
        targets[f"int8_vs_{own}"] = i8 / engines[own]["median_tok_s"]
        targets["int8_at_least_llama_cpp_same_gguf"] = i8 >= engines[own]["median_tok_s"]
    if "llama.cpp gguf Q8_0" in engines:
        targets["int8_vs_llama.cpp_q8_0"] = i8 / engines["llama.cpp gguf Q8_0"]["median_tok_s"]

    print()
    print_table(["engine", "MB/token", "bound tok/s", "tok/s", "min", "max", "% of bound", "1st diff vs fp32"],
                [[n, e["weight_bytes_per_token"] / 1e6, e["bound_tok_s"], e["median_tok_s"], e["min_tok_s"],
                  e["max_tok_s"], 100 * e["fraction_of_bound"],
                  "-" if e["first_divergence_from_kvfuse_fp32"] is None else e["first_divergence_from_kvfuse_fp32"]]
                 for n, e in engines.items()])
    print()
    print_table(["variant", "steps", "mean cos", "min cos", "mean max|d|", "mean KL", "greedy agree",
                 "same answer", "median 1st diff"],
                [[v, a["steps"], a["mean_cosine"], a["min_cosine"], a["mean_max_abs_diff"], a["mean_kl"],
                  a["greedy_agreement"], a["identical_answers"], a["median_first_divergence"]]
                 for v, a in agree["variants"].items()])
    print()
    print("prefill " + ", ".join(f"{k}: {v['median_s']:.3f} s ({v['tokens']} tokens)" for k, v in prefill.items()))
    print("targets: " + ", ".join(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}" for k, v in targets.items()))
    busy = [x["other_cores"] for x in rounds_load if x is not None]
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min); other processes used "
          + (f"{max(busy):.2f} cores at most in a round" if busy else "? cores") + f"; {time.time() - t_start:.0f} s in all")
    result = {
        "model": args.model, "threads": args.threads, "prompt_tokens": len(prompt), "decode_tokens": args.tokens,
        "runs": args.runs, "kv_dtype": "float16 (kvfuse engine), float32 (transformers), f16 (llama.cpp default)",
        "bandwidth": bandwidth, "engines": engines, "agreement": agree, "prefill": prefill, "targets": targets,
        "issue_baseline_tok_s": BASELINE_TOK_S, "llama_cpp": llama_info, "quick": args.quick,
        "load_average_before": load_before, "load_average_after": load_after,
        "other_processes_per_round": rounds_load,
    }
    name = f"decode{args.tag}"
    print(f"wrote {write_json(name, result)}")
    plot(result, plot_path(name))
    print(f"wrote {plot_path(name)}")


if __name__ == "__main__":
    main()
