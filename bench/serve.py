"""Serving benchmark: concurrent OpenAI-API clients against a real ``kvfuse serve`` process.

Two workloads, each at 1, 4 and 16 concurrent clients, each with the KV cache on and off:

- ``shared-prefix`` (MuSiQue **dev** split, examples 0-49 of ``../shared/data/musique_s.json``): a
  request is one example's documents (truncated to ``--doc-words`` words, ~800 tokens) followed by a
  question; each document set is asked ``--questions`` questions (its own, then other examples'), so
  requests share long document prefixes (4 sets x 4 questions = 16 requests, enough for 16 clients).
  Clients take the requests in order from one queue.
- ``chat``: 16 multi-turn conversations whose history grows: a system message holding one MuSiQue
  document, then ``--turns`` user turns; each turn sends the whole history including the server's
  previous replies, so a turn's prompt starts with the previous turn's. Each client drives one
  conversation at a time (its turns are sequential).

Every concurrency level replays the same requests; prompts are kept under ~1k tokens and answers
at 8 tokens so that the full run fits in ~15 minutes even when the 2 CPU cores are shared
(prefill measured at 3-7 ms/token there).

Cache on vs off: one server process, with ``"cache": false`` per request for the off runs. The
engine then skips lookup, load and store entirely (the code path of a server without a cache),
and both variants run in the same process under the same warm-up and memory conditions; two
processes would double the model memory and start-up time on this small machine. Every cache-on
run uses its own ``cache_salt`` so that it starts cold and profits only from reuse within the run.

Measured client-side through streaming: TTFT = time from sending the request to the first chunk
with content; requests/s = completed requests / wall time of the run; errors = failed requests.
The server runs one generation at a time, so more clients mostly add queueing to TTFT.

Results: ``docs/bench/serve.json`` and ``docs/bench/serve.png`` (``--quick``: ``serve-quick.*``, a
smoke run with few requests, about 2 minutes). The full run takes 7-14 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfuse.testing import ServerProcess, ensure_model  # noqa: E402

DEV = range(0, 50)  # musique_s.json: 0-49 dev, 50-149 test (never used here)
SYSTEM = "Answer the question using the documents. Reply with a short answer only."


@dataclass
class Request:
    """One request of a run: a completion prompt, or chat messages (a chat turn is built at run time)."""

    prompt: str | None = None
    conversation: list[str] | None = None  # chat: the user turns; the history is kept per client
    document: str = ""  # chat: the document in the system message


@dataclass
class RunResult:
    workload: str
    concurrency: int
    cache: bool
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    latency_p50_ms: float | None
    mean_prompt_tokens: float | None
    mean_cached_tokens: float | None
    error_samples: list[str] = field(default_factory=list)


def load_dev(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [data[i] for i in DEV]


def documents(example: dict, words: int) -> str:
    """The example's documents, in order, cut to ``words`` words in total."""
    out, left = [], words
    for i, ctx in enumerate(example["ctxs"]):
        if left <= 0:
            break
        w = ctx["text"].split()[:left]
        left -= len(w)
        out.append(f"Document {i + 1}: {' '.join(w)}")
    return "\n".join(out)


def shared_prefix_requests(examples: list[dict], doc_sets: int, questions: int, words: int) -> list[Request]:
    reqs = []
    for i in range(doc_sets):
        docs = documents(examples[i], words)
        for q in range(questions):
            question = examples[(i + q) % len(examples)]["question"]  # its own first, then others'
            reqs.append(Request(prompt=f"{SYSTEM}\n\n{docs}\n\nQuestion: {question}\nAnswer:"))
    return reqs


def chat_requests(examples: list[dict], conversations: int, turns: int, words: int) -> list[Request]:
    reqs = []
    for c in range(conversations):
        ex = examples[(c * 7) % len(examples)]
        doc = documents(ex, words)
        asks = [ex["question"]] + [examples[(c * 7 + t) % len(examples)]["question"] for t in range(1, turns)]
        reqs.append(Request(conversation=asks, document=doc))
    return reqs


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class Runner:
    """Runs one (workload, concurrency, cache) pass with threads of streaming OpenAI clients."""

    def __init__(self, base_url: str, model: str, max_tokens: int):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
        self.model = model
        self.max_tokens = max_tokens

    def _stream(self, extra: dict, prompt: str | None = None, messages: list | None = None) -> dict:
        t0 = time.perf_counter()
        ttft, text, usage = None, [], None
        common = dict(model=self.model, max_tokens=self.max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True}, extra_body=extra)
        if messages is not None:
            stream = self.client.chat.completions.create(messages=messages, **common)
        else:
            stream = self.client.completions.create(prompt=prompt, **common)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            piece = chunk.choices[0].delta.content if messages is not None else chunk.choices[0].text
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
        return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "latency": time.perf_counter() - t0,
                "text": "".join(text), "prompt_tokens": usage.prompt_tokens if usage else None,
                "cached": usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None}

    def run(self, workload: str, reqs: list[Request], concurrency: int, cache: bool, salt: str) -> RunResult:
        extra = {"cache_salt": salt} if cache else {"cache": False}
        work: queue.Queue[Request] = queue.Queue()
        for r in reqs:
            work.put(r)
        samples, errors, lock = [], [], threading.Lock()

        def one(**kw):
            try:
                s = self._stream(extra, **kw)
                with lock:
                    samples.append(s)
                return s
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                return None

        def client():
            while True:
                try:
                    r = work.get_nowait()
                except queue.Empty:
                    return
                if r.conversation is None:
                    one(prompt=r.prompt)
                    continue
                history = [{"role": "system", "content": f"{SYSTEM}\n\n{r.document}"}]
                for ask in r.conversation:
                    history.append({"role": "user", "content": ask})
                    s = one(messages=list(history))
                    if s is None:
                        break
                    history.append({"role": "assistant", "content": s["text"]})

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ttft = [s["ttft"] * 1000 for s in samples]
        prompt = [s["prompt_tokens"] for s in samples if s["prompt_tokens"] is not None]
        cached = [s["cached"] for s in samples if s["cached"] is not None]
        return RunResult(
            workload, concurrency, cache, len(samples), len(errors), round(wall, 2), round(len(samples) / wall, 3),
            _r(percentile(ttft, 0.5)), _r(percentile(ttft, 0.95)),
            _r(percentile([s["latency"] * 1000 for s in samples], 0.5)),
            _r(statistics.fmean(prompt)) if prompt else None, _r(statistics.fmean(cached)) if cached else None,
            errors[:3],
        )


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def print_table(results: list[RunResult]) -> None:
    head = f"{'workload':<14}{'clients':>8}{'cache':>7}{'reqs':>6}{'errors':>7}{'req/s':>8}" \
           f"{'TTFT p50':>10}{'TTFT p95':>10}{'prompt':>8}{'cached':>8}"
    print(head)
    print("-" * len(head))
    for r in results:
        fmt = lambda v, unit="": "-" if v is None else f"{v:.0f}{unit}"  # noqa: E731
        print(f"{r.workload:<14}{r.concurrency:>8}{'on' if r.cache else 'off':>7}{r.requests:>6}{r.errors:>7}"
              f"{r.requests_per_s:>8.2f}{fmt(r.ttft_p50_ms, 'ms'):>10}{fmt(r.ttft_p95_ms, 'ms'):>10}"
              f"{fmt(r.mean_prompt_tokens):>8}{fmt(r.mean_cached_tokens):>8}")


def plot(results: list[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in results}, reverse=True)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, w in enumerate(workloads):
        for cache, style in ((True, "-o"), (False, "--s")):
            rs = sorted((r for r in results if r.workload == w and r.cache == cache), key=lambda r: r.concurrency)
            xs = [r.concurrency for r in rs]
            label = "cache on" if cache else "cache off"
            axes[row][0].plot(xs, [r.ttft_p50_ms or 0 for r in rs], style, label=f"{label} p50")
            axes[row][0].plot(xs, [r.ttft_p95_ms or 0 for r in rs], style, alpha=0.4, label=f"{label} p95")
            axes[row][1].plot(xs, [r.requests_per_s for r in rs], style, label=label)
        axes[row][0].set(title=f"{w}: time to first token (client-side)", ylabel="ms")
        axes[row][1].set(title=f"{w}: throughput", ylabel="requests/s")
        levels = sorted({r.concurrency for r in results})
        for ax in axes[row]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent clients")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: few requests, clients 1 and 4")
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "musique_s.json")
    p.add_argument("--home", default=os.environ.get("KVFUSE_HOME") or str(Path.home() / ".cache" / "kvfuse"))
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", type=int, nargs="+", help="client counts (default 1 4 16; quick: 1 4)")
    p.add_argument("--max-tokens", type=int, help="tokens per answer (default 8; quick: 4)")
    p.add_argument("--doc-words", type=int, help="words of documents per shared-prefix prompt (default 600, "
                   "~800 tokens: 3 shared 256-token chunks; quick: 300)")
    p.add_argument("--doc-sets", type=int, help="document sets of the shared-prefix workload (default 4; quick: 2)")
    p.add_argument("--questions", type=int, help="questions per document set (default 4; quick: 2)")
    p.add_argument("--conversations", type=int, help="chat conversations per run (default 16; quick: 2)")
    p.add_argument("--turns", type=int, default=2, help="user turns per conversation (default 2)")
    p.add_argument("--chat-doc-words", type=int, default=180,
                   help="words of the document in a chat's system message (default 180: a first turn of ~300 tokens)")
    p.add_argument("--disk", action="store_true", help="add the disk tier (a temp directory) to the memory tier")
    p.add_argument("--out", type=Path, help="output prefix (default docs/bench/serve; quick: docs/bench/serve-quick)")
    args = p.parse_args(argv)
    q = args.quick
    conc = args.concurrency or ([1, 4] if q else [1, 4, 16])
    max_tokens = args.max_tokens or (4 if q else 8)
    doc_sets, questions = args.doc_sets or (2 if q else 4), args.questions or (2 if q else 4)
    doc_words, turns = args.doc_words or (300 if q else 600), args.turns
    conversations = args.conversations or (2 if q else 16)
    out = args.out or REPO / "docs" / "bench" / ("serve-quick" if q else "serve")

    examples = load_dev(args.data)
    print(f"data: {args.data} -- MuSiQue dev split (examples {DEV.start}-{DEV.stop - 1}); the test split is not used",
          file=sys.stderr)
    ensure_model(args.home, args.model)
    tmp = tempfile.TemporaryDirectory(prefix="kvfuse-bench-serve-")
    cache = {"disk": args.disk, "disk_path": str(Path(tmp.name) / "kv")}
    server = ServerProcess(args.home, config={"model": args.model, "cache": cache,
                                              "server": {"max_queue": 256, "max_tokens_limit": 256}})
    results: list[RunResult] = []
    t_start = time.perf_counter()
    with server:
        runner = Runner(server.base_url, args.model, max_tokens)
        runner.run("warmup", shared_prefix_requests(examples, 1, 1, 50), 1, False, "warmup")
        # The same requests at every concurrency level: only the number of clients changes.
        plans = [("shared-prefix", shared_prefix_requests(examples, doc_sets, questions, doc_words)),
                 ("chat", chat_requests(examples, conversations, turns, args.chat_doc_words))]
        for c in conc:
            for workload, reqs in plans:
                for cache_on in (False, True):
                    salt = f"bench-{workload}-{c}-{time.time_ns()}"
                    r = runner.run(workload, reqs, c, cache_on, salt)
                    results.append(r)
                    print(f"  {workload:<14} clients={c:<3} cache={'on ' if cache_on else 'off'} "
                          f"{r.requests} requests, {r.errors} errors, {r.wall_s:.1f} s", file=sys.stderr)
    total = time.perf_counter() - t_start
    tmp.cleanup()

    print_table(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"mode": "quick" if q else "full", "split": "MuSiQue dev (examples 0-49 of musique_s.json)",
            "model": args.model, "max_tokens": max_tokens, "doc_words": doc_words, "doc_sets": doc_sets,
            "questions": questions, "conversations": conversations, "turns": turns, "chat_doc_words": args.chat_doc_words,
            "tiers": "memory+disk" if args.disk else "memory", "cache_off": "per-request cache: false, same server",
            "ttft": "client-side, request sent -> first streamed chunk with content", "total_s": round(total, 1),
            "cpu_count": os.cpu_count()}
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    plot(results, Path(f"{out}.png"), f"kvfuse serve, {args.model}, MuSiQue dev, {meta['mode']} run")
    print(f"wrote {out}.json and {out}.png ({total:.0f} s)", file=sys.stderr)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
