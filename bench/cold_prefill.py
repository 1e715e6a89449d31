"""Cold prompts through the server: kvfuse's prefill passes against vLLM CPU's, and the decode after.

Why it exists: in the agents benchmark (docs/benchmarks.md "Agents") vLLM CPU answered the cold
first call (~3,100 tokens) in 11.5 s where kvfuse took 18.1 s. This measures that part alone.
Per prompt length (``--lengths``: MuSiQue dev text, Qwen2.5-0.5B by default), one greedy streamed
completion per candidate and round (``--max-tokens`` 32, ``ignore_eos``), every prompt headed by
a line naming its candidate, round and length, so that no request finds another's KV (every one
is cold, in every engine). Measured client side: TTFT (the prefill, as a user sees it) and the
decode rate after it ((tokens - 1) / (last token - first token)).

Candidates:

- ``kvfuse``: ``kvfuse serve`` as configured by default (``engine.max_prefill_tokens`` 2048: a
  prompt alone is computed in passes of up to 2,048 tokens, whose products run on PyTorch's GEMM
  from ``packed.GEMM_ROWS`` rows);
- ``kvfuse-256``: the same with ``engine.max_prefill_tokens: null``, so every pass holds at most
  ``engine.max_step_tokens`` (256) tokens: kvfuse before that setting existed;
- ``vllm``: vLLM CPU (``bench/lib/vllm.py``'s tuned set-up, prefix caching on, float32, the same
  HF folder), started after the kvfuse servers stop (never two engines computing at once).

The two kvfuse servers run side by side and their requests are interleaved round by round
(alternating order); vLLM's rounds follow. Medians with min and max; JSON and PNG under
``docs/bench/`` (``cold_prefill``).

    python bench/cold_prefill.py                               # qwen2.5-0.5b, 1024 and 3072, 3 rounds
    python bench/cold_prefill.py --quick --servers kvfuse      # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib import servers as srvs
from bench.lib.client import timed_completion
from bench.lib.data import dev_text_tokens
from bench.lib.results import output_name, print_table, pyplot, save_figure, write_json
from bench.lib.rounds import interleaved, spread

KVFUSE = {"kvfuse": {}, "kvfuse-256": {"engine": {"max_prefill_tokens": None}}}
LABELS = {
    "kvfuse": "kvfuse (passes up to 2,048 tokens)",
    "kvfuse-256": "kvfuse, 256-token passes (before)",
    "vllm": "vLLM CPU (tuned)",
}


def stream(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy streamed completion: TTFT, decode rate, tokens, text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    first, last, text, usage = timed_completion(base_url, body, timeout=1800)
    n = usage.get("completion_tokens", 0)
    rate = (n - 1) / (last - first) if n > 1 and last > first else None
    return {"ttft_s": first, "decode_tok_s": rate, "tokens": n, "text": text}


def prompt_for(tokenizer, body: list[int], head: str, length: int) -> list[int]:
    """``length`` token ids: the ``head`` line, then the dev text."""
    ids = tokenizer.encode(head + "\n", add_special_tokens=False)
    return ids + body[: length - len(ids)]


def measure(args, name: str, base_url: str, tokenizer, body: list[int], r: int) -> dict:
    out = {}
    for length in args.lengths:
        head = f"Request {name} round {r} length {length}."
        res = stream(
            base_url, args.model, prompt_for(tokenizer, body, head, length), args.max_tokens
        )
        out[length] = res
        print(
            f"  round {r} {name:<11} {length:>5} tokens: TTFT {res['ttft_s']:.2f} s, "
            f"decode {res['decode_tok_s'] or 0:.2f} tok/s",
            file=sys.stderr,
        )
    return out


def run_kvfuse(args, names, tokenizer, body) -> dict:
    import contextlib
    import tempfile

    with contextlib.ExitStack() as stack:
        urls = {}
        for name in names:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfuse-cold-"))
            config = srvs.deep_merge(
                {"model": args.model, "cache": {"disk": False, "disk_path": f"{tmp}/kv"}},
                KVFUSE[name],
            )
            log = srvs.log_path(args, "cold_prefill", name)
            srv = stack.enter_context(srvs.kvfuse_process(args, config, log, {}))
            urls[name] = srv.base_url
        return interleaved(
            {n: (lambda r, n=n: measure(args, n, urls[n], tokenizer, body, r)) for n in names},
            args.rounds,
            alternate=True,
        )


def run_vllm(args, tokenizer, body) -> dict:
    srv, _env = srvs.vllm_process(args, [], srvs.log_path(args, "cold_prefill", "vllm"))
    print("starting vLLM (~4 min)", file=sys.stderr)
    with srv:
        return interleaved(
            {"vllm": lambda r: measure(args, "vllm", srv.base_url, tokenizer, body, r)},
            args.rounds,
        )


def summarize(samples: dict, lengths: list[int]) -> list[dict]:
    rows = []
    for name, runs in samples.items():
        for length in lengths:
            ttft = [run[length]["ttft_s"] for run in runs]
            rate = [run[length]["decode_tok_s"] for run in runs if run[length]["decode_tok_s"]]
            rows.append(
                {
                    "candidate": name,
                    "tokens": length,
                    **spread(ttft, "_ttft_s"),
                    **(spread(rate, "_decode_tok_s") if rate else {}),
                    "prefill_tok_s": round(length / spread(ttft)["median"], 1),
                    "texts": [run[length]["text"] for run in runs],
                }
            )
    return rows


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    lengths = sorted({r["tokens"] for r in rows})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [
            next(r for r in rows if r["candidate"] == name and r["tokens"] == n) for n in lengths
        ]
        xs = [j + i * width for j in range(len(lengths))]
        med = [v["median_ttft_s"] for v in vals]
        err = [
            [m - v["min_ttft_s"] for m, v in zip(med, vals)],
            [v["max_ttft_s"] - m for m, v in zip(med, vals)],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=LABELS.get(name, name))
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(lengths))])
    ax.set_xticklabels([f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT of a cold prompt (s)")
    ax.set_title("Cold prefill through the server (median, min-max)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    srvs.add_server_flags(p, "cold_prefill", default="kvfuse,kvfuse-256,vllm")
    p.set_defaults(model="qwen2.5-0.5b")
    p.add_argument("--lengths", default="1024,3072", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="512 tokens, 1 round, 8 tokens")
    p.add_argument("--tag", default=None)
    args = p.parse_args()
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    for n in names:
        if n not in LABELS:
            p.error(f"unknown candidate {n!r}: choose from {', '.join(LABELS)}")
    if args.quick:
        args.lengths, args.rounds, args.max_tokens = "512", 1, 8
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    from kvfuse.models.tokenizer import Tokenizer
    from kvfuse_testkit import ensure_model

    ensure_model(args.home, args.model)
    tokenizer = Tokenizer(srvs.model_folder(args.home, args.model))
    body = dev_text_tokens(tokenizer, max(args.lengths))
    samples = {}
    kv = [n for n in names if n in KVFUSE]
    if kv:
        samples.update(run_kvfuse(args, kv, tokenizer, body))
    if "vllm" in names:
        samples.update(run_vllm(args, tokenizer, body))
    rows = summarize(samples, args.lengths)
    print_table(
        ["candidate", "tokens", "TTFT s", "min", "max", "prefill tok/s", "decode tok/s"],
        [
            [
                LABELS[r["candidate"]],
                r["tokens"],
                round(r["median_ttft_s"], 2),
                round(r["min_ttft_s"], 2),
                round(r["max_ttft_s"], 2),
                r["prefill_tok_s"],
                round(r.get("median_decode_tok_s", 0), 2),
            ]
            for r in rows
        ],
    )
    name = output_name("cold_prefill", args.tag, args.quick)
    print(f"wrote {write_json(name, {'args': vars(args), 'rows': rows}, default=str)}")
    plot(rows, name)


if __name__ == "__main__":
    main()
