"""Serving benchmark: concurrent OpenAI-API clients against a real ``kvfuse serve`` process, and
against vLLM's CPU build on the same model and workloads in the same run.

Workloads (``--workloads``, default all four; every one replays the same requests at every client
count, only the number of concurrent clients changes):

- ``shared-prefix`` (completions; MuSiQue **dev** split, examples 0-49 of ``../shared/data/musique_s.json``):
  a request is one example's documents (cut to ``--doc-words`` words, ~800 tokens) then a question;
  each document set is asked ``--questions`` questions (its own, then other examples'), so requests
  share long document prefixes (4 sets x 4 questions = 16 requests). Answers: ``--max-tokens`` (8).
- ``chat`` (chat completions): 16 multi-turn conversations whose history grows: a system message
  holding one MuSiQue dev document, then ``--turns`` user turns; each turn sends the whole history,
  the server's previous replies included. A client drives one conversation at a time (its turns in
  order). Answers: ``--max-tokens`` (8).
- ``sharegpt`` (chat completions; ``../shared/data/sharegpt_multiturn_dev.jsonl``, the dev file):
  the first user message of the first 32 conversations, cut to 400 characters, one request each,
  48 tokens per answer.
- ``long-answer`` (chat completions): 16 one-sentence prompts asking for a long explanation, 128
  tokens per answer: decode-bound.

Servers (``--servers``, default ``kvfuse,vllm``), one after the other, never two at once:

- ``kvfuse``: a ``kvfuse serve`` child process (``kvfuse_testkit.ServerProcess``), cache on and off
  in the same process: ``"cache": false`` per request for the off runs (the engine then skips
  lookup, load and store entirely, the code path of a server without a cache). Every cache-on run
  uses its own ``cache_salt`` so that it starts cold and profits only from reuse within the run.
  ``--kvfuse-config FILE`` (YAML, merged over the benchmark's own settings) and ``--kvfuse-arg``
  (extra ``kvfuse serve`` flags) configure it, e.g. the engine's batching settings.
- ``vllm``: vLLM's CPU build (``bench/vllm_server.py``; venv from ``bench/setup_vllm.sh``) on the
  very same HF folder (``$KVFUSE_HOME/models/smollm2``), float32, its prefix caching on
  (``--enable-prefix-caching``), run once per workload and client count, labelled "prefix caching
  on". Every run sends its own ``cache_salt`` too (vLLM honours it), so it also starts cold.

Every request is greedy (temperature 0) and streamed (``stream_options={"include_usage": True}``)
through the official ``openai`` client. ``ignore_eos`` (``--ignore-eos auto``) is sent only when
every server accepts it (vLLM does; kvfuse's request schema has it), so every answer has exactly
``max_tokens`` tokens; output-token counts are what was generated (``usage.completion_tokens`` of
the last chunk).

Metrics per (server, cache, workload, clients) run, all client-side: requests/s and output
tokens/s (completed requests and summed ``completion_tokens`` / wall time of the run); TTFT p50/p95
(request sent -> first chunk with content); inter-token latency p50/p95 (gaps between consecutive
content chunks after the first, pooled over the run's requests); errors; ``exact``: the fraction of
outputs identical to the same server's (and cache mode's) 1-client run. Tables: tokens/s at N
clients / at 1 client per server, kvfuse / vLLM per workload and client count (tokens/s and TTFT
p50, and how many outputs agree), and the issue's targets with a verdict.

Results: ``docs/bench/serve.json`` and ``docs/bench/serve.png`` (``--tag T``: ``serve-T.*``;
``--quick``: ``serve-quick.*``, a smoke run of the plumbing with few requests and clients 1 and 4).
``--merge`` keeps the results of (server, workload) pairs that this run does not redo from the
existing JSON (each result records when it ran). The JSON is rewritten after every workload, so an
interrupted run keeps what it measured.

Full run (all four workloads, clients 1/4/16/32, kvfuse cache on and off, then vLLM):

    KVFUSE_HOME=... .venv/bin/python bench/serve.py

About 1.5 hours on the 2-core machine while kvfuse serves one request at a time (~80 min of kvfuse,
mostly the 1-client-equivalent decode of sharegpt and long-answer repeated at every client count
and cache mode, then ~20 min of vLLM including its ~3.5-minute start-up); less once kvfuse
batches. ``--quick`` takes ~2.5 minutes for kvfuse and ~4 for vLLM (start-up included).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import queue
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kvfuse_testkit import ServerProcess, ensure_model

DATA = REPO.parent / "shared" / "data"
DEV = range(0, 50)  # musique_s.json: 0-49 dev, 50-149 test (never used here)
SYSTEM = "Answer the question using the documents. Reply with a short answer only."
WORKLOADS = ("shared-prefix", "chat", "sharegpt", "long-answer")
SERVERS = ("kvfuse", "vllm")
VLLM_REFERENCE = {
    "workload": "sharegpt",
    "clients_1": 8.5,
    "clients_16": 54.0,
}  # the measurement

LONG_ANSWER_PROMPTS = [
    "Explain in detail how photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Describe step by step how a bill becomes a law in the United States.",
    "Explain thoroughly how the human immune system recognises and fights a viral infection.",
    "Give a detailed explanation of how an internal combustion engine works.",
    "Explain in depth why the seasons change over the course of a year on Earth.",
    "Describe in detail the causes and consequences of the French Revolution.",
    "Explain carefully how a computer executes a program, from source code to machine instructions.",
    "Give a long and detailed explanation of how vaccines are developed and tested.",
    "Explain in detail how the water cycle works and why it matters for life on Earth.",
    "Describe thoroughly how plate tectonics shapes mountains, earthquakes and volcanoes.",
    "Explain step by step how the internet delivers a web page to your browser.",
    "Give a detailed explanation of how supply and demand set prices in a market economy.",
    "Explain in depth how the heart pumps blood through the body and what each chamber does.",
    "Describe in detail how a star is born, lives and dies.",
    "Explain thoroughly how a neural network learns from examples during training.",
    "Give a detailed explanation of how bread dough rises and what happens while it bakes.",
]


# ------------------------------------------------------------------------------------ requests


@dataclass
class Request:
    """One unit of work for a client: a completion prompt, a one-shot chat, or a conversation."""

    key: str  # names the request (a conversation's turns: key/turnN) to compare outputs across runs
    prompt: str | None = None
    messages: list[dict] | None = None
    conversation: list[str] | None = None  # chat: the user turns; the history is kept per client
    document: str = ""  # chat: the document in the system message


@dataclass
class Workload:
    name: str
    requests: list[Request]
    max_tokens: int
    source: str


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


def shared_prefix_requests(
    examples: list[dict], doc_sets: int, questions: int, words: int
) -> list[Request]:
    reqs = []
    for i in range(doc_sets):
        docs = documents(examples[i], words)
        for q in range(questions):
            question = examples[(i + q) % len(examples)]["question"]  # its own first, then others'
            reqs.append(
                Request(
                    f"set{i}/q{q}", prompt=f"{SYSTEM}\n\n{docs}\n\nQuestion: {question}\nAnswer:"
                )
            )
    return reqs


def chat_requests(
    examples: list[dict], conversations: int, turns: int, words: int
) -> list[Request]:
    reqs = []
    for c in range(conversations):
        ex = examples[(c * 7) % len(examples)]
        doc = documents(ex, words)
        asks = [ex["question"]] + [
            examples[(c * 7 + t) % len(examples)]["question"] for t in range(1, turns)
        ]
        reqs.append(Request(f"conv{c}", conversation=asks, document=doc))
    return reqs


def sharegpt_requests(path: Path, n: int, chars: int) -> list[Request]:
    """The first user message of the first ``n`` conversations of the (dev) ShareGPT file, cut to ``chars``."""
    reqs = []
    with open(path) as f:
        for line in f:
            if len(reqs) == n:
                break
            conv = json.loads(line)
            first = next(m for m in conv["messages"] if m["role"] == "user")
            reqs.append(
                Request(
                    f"{conv['id']}",
                    messages=[{"role": "user", "content": first["content"][:chars]}],
                )
            )
    if len(reqs) < n:
        raise ValueError(f"{path} holds only {len(reqs)} conversations, {n} wanted")
    return reqs


def long_answer_requests(n: int) -> list[Request]:
    if n > len(LONG_ANSWER_PROMPTS):
        raise ValueError(f"at most {len(LONG_ANSWER_PROMPTS)} long-answer prompts")
    return [
        Request(f"long{i}", messages=[{"role": "user", "content": p}])
        for i, p in enumerate(LONG_ANSWER_PROMPTS[:n])
    ]


# -------------------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    server: str  # kvfuse | vllm
    cache: bool
    label: str  # e.g. "kvfuse cache on", "vLLM CPU (prefix caching on)"
    workload: str
    concurrency: int
    units: int  # independent request streams (requests, or conversations): clients beyond it idle
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    latency_p50_ms: float | None
    mean_prompt_tokens: float | None
    mean_cached_tokens: float | None
    mean_output_tokens: float | None
    exact: float | None = None  # fraction of outputs identical to the same server's 1-client run
    exact_n: str | None = None  # "k/n"
    ran_at: str = ""
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


class Runner:
    """Runs one (workload, concurrency) pass with threads of streaming OpenAI clients against one server."""

    def __init__(self, base_url: str, model: str, server: str, ignore_eos: bool):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=1800)
        self.model = model
        self.server = server
        self.ignore_eos = ignore_eos

    def _stream(
        self, extra: dict, max_tokens: int, prompt: str | None = None, messages: list | None = None
    ) -> dict:
        t0 = time.perf_counter()
        arrivals, text, usage = [], [], None
        common = dict(
            model=self.model,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        if messages is not None:
            stream = self.client.chat.completions.create(messages=messages, **common)
        else:
            stream = self.client.completions.create(prompt=prompt, **common)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            piece = (
                chunk.choices[0].delta.content if messages is not None else chunk.choices[0].text
            )
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
        end = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return {
            "ttft": (arrivals[0] if arrivals else end) - t0,
            "latency": end - t0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else len(arrivals),
            "cached": details.cached_tokens
            if details is not None and details.cached_tokens is not None
            else None,
        }

    def extra(self, cache: bool, salt: str) -> dict:
        extra: dict = (
            {"cache_salt": salt} if cache else {"cache": False}
        )  # "cache" is kvfuse's; vLLM runs cache on
        if self.ignore_eos:
            extra["ignore_eos"] = True
        return extra

    def run(
        self, wl: Workload, concurrency: int, cache: bool, salt: str, label: str
    ) -> tuple[RunResult, dict[str, str]]:
        extra = self.extra(cache, salt)
        work: queue.Queue[Request] = queue.Queue()
        for r in wl.requests:
            work.put(r)
        samples, errors, outputs, lock = [], [], {}, threading.Lock()

        def one(key: str, **kw):
            try:
                s = self._stream(extra, wl.max_tokens, **kw)
                with lock:
                    samples.append(s)
                    outputs[key] = s["text"]
                return s
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors.append(f"{key}: {type(e).__name__}: {e}"[:300])
                return None

        def client():
            while True:
                try:
                    r = work.get_nowait()
                except queue.Empty:
                    return
                if r.conversation is None:
                    one(r.key, prompt=r.prompt, messages=r.messages)
                    continue
                history = [{"role": "system", "content": f"{SYSTEM}\n\n{r.document}"}]
                for t, ask in enumerate(r.conversation):
                    history.append({"role": "user", "content": ask})
                    s = one(f"{r.key}/turn{t}", messages=list(history))
                    if s is None:
                        break
                    history.append({"role": "assistant", "content": s["text"]})

        ran_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ttft = [s["ttft"] * 1000 for s in samples]
        itl = [g * 1000 for s in samples for g in s["itl"]]
        prompt = [s["prompt_tokens"] for s in samples if s["prompt_tokens"] is not None]
        cached = [s["cached"] for s in samples if s["cached"] is not None]
        out_tokens = [s["completion_tokens"] for s in samples]
        result = RunResult(
            self.server,
            cache,
            label,
            wl.name,
            concurrency,
            len(wl.requests),
            len(samples),
            len(errors),
            round(wall, 2),
            round(len(samples) / wall, 3),
            sum(out_tokens),
            round(sum(out_tokens) / wall, 2),
            _r(percentile(ttft, 0.5)),
            _r(percentile(ttft, 0.95)),
            _r(percentile(itl, 0.5)),
            _r(percentile(itl, 0.95)),
            _r(percentile([s["latency"] * 1000 for s in samples], 0.5)),
            _r(statistics.fmean(prompt)) if prompt else None,
            _r(statistics.fmean(cached)) if cached else None,
            _r(statistics.fmean(out_tokens)) if out_tokens else None,
            ran_at=ran_at,
            error_samples=errors[:3],
        )
        return result, outputs


def warm_up(runner: Runner, clients: int) -> None:
    """A completion and a chat, then ``clients`` short chats at once (first-use costs of batch shapes)."""
    wl = Workload(
        "warmup",
        [
            Request("w0", prompt="The capital of France is"),
            Request("w1", messages=[{"role": "user", "content": "Say hello."}]),
        ],
        4,
        "",
    )
    runner.run(wl, 1, False if runner.server == "kvfuse" else True, "warmup", "warmup")
    wl = Workload(
        "warmup",
        [
            Request(f"w{i}", messages=[{"role": "user", "content": f"Count to {i + 2}."}])
            for i in range(clients)
        ],
        4,
        "",
    )
    runner.run(wl, clients, False if runner.server == "kvfuse" else True, "warmup", "warmup")


# ---------------------------------------------------------------------------------- servers


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def kvfuse_accepts_ignore_eos() -> bool:
    """Whether kvfuse's request schema has ``ignore_eos`` (unknown fields are silently ignored)."""
    from kvfuse.server.schemas import SamplingRequest

    return "ignore_eos" in SamplingRequest.model_fields


def server_accepts(url: str, field_name: str) -> bool | None:
    """Whether the server's OpenAPI schema names ``field_name`` (None: no schema to read)."""
    import httpx

    try:
        r = httpx.get(url + "/openapi.json", timeout=10)
        return field_name in r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def labels(server: str, cache: bool) -> str:
    if server == "vllm":
        return "vLLM CPU (prefix caching on)"
    return f"kvfuse cache {'on' if cache else 'off'}"


# ----------------------------------------------------------------------------------- tables


def key(r: dict) -> tuple:
    return r["server"], r["cache"], r["workload"], r["concurrency"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def ratio_tables(results: list[dict], outputs: dict) -> dict:
    """Scaling (tokens/s at N clients / at 1) per server, kvfuse / vLLM per workload and clients,
    output agreement between servers, and the issue's targets with verdicts."""
    by = {key(r): r for r in results}
    scaling, versus, targets = [], [], []
    for r in results:
        one = by.get((r["server"], r["cache"], r["workload"], 1))
        if one and one["output_tokens_per_s"]:
            scaling.append(
                {
                    "label": r["label"],
                    "workload": r["workload"],
                    "clients": r["concurrency"],
                    "tokens_per_s": r["output_tokens_per_s"],
                    "x_vs_1_client": round(
                        r["output_tokens_per_s"] / one["output_tokens_per_s"], 2
                    ),
                }
            )
    for r in results:
        if r["server"] != "kvfuse":
            continue
        v = by.get(("vllm", True, r["workload"], r["concurrency"]))
        if v is None:
            continue
        a = outputs.get(f"{r['label']}|{r['workload']}|{r['concurrency']}", {})
        b = outputs.get(f"{v['label']}|{v['workload']}|{v['concurrency']}", {})
        both = sorted(set(a) & set(b))
        versus.append(
            {
                "label": r["label"],
                "workload": r["workload"],
                "clients": r["concurrency"],
                "kvfuse_tokens_per_s": r["output_tokens_per_s"],
                "vllm_tokens_per_s": v["output_tokens_per_s"],
                "tokens_per_s_ratio": _ratio(r["output_tokens_per_s"], v["output_tokens_per_s"]),
                "kvfuse_ttft_p50_ms": r["ttft_p50_ms"],
                "vllm_ttft_p50_ms": v["ttft_p50_ms"],
                "ttft_p50_ratio": _ratio(r["ttft_p50_ms"], v["ttft_p50_ms"]),
                "same_outputs": f"{sum(a[k] == b[k] for k in both)}/{len(both)}" if both else None,
            }
        )

    def verdict(name: str, value, goal, ok: bool | None) -> None:
        targets.append({"target": name, "value": value, "goal": goal, "met": ok})

    on = lambda w, c: by.get(("kvfuse", True, w, c))  # noqa: E731  (cache on: the mode compared with vLLM's)
    vl = lambda w, c: by.get(("vllm", True, w, c))  # noqa: E731
    s1, s16 = on("sharegpt", 1), on("sharegpt", 16)
    if s1 and s16 and s1["output_tokens_per_s"]:
        x = round(s16["output_tokens_per_s"] / s1["output_tokens_per_s"], 2)
        verdict(
            "sharegpt: kvfuse (cache on) tokens/s at 16 clients / at 1 client", x, ">= 6", x >= 6
        )
    if s16:
        t = s16["output_tokens_per_s"]
        verdict(
            "sharegpt: kvfuse (cache on) tokens/s at 16 clients vs the issue's vLLM CPU figure",
            t,
            f">= {VLLM_REFERENCE['clients_16']}",
            t >= VLLM_REFERENCE["clients_16"],
        )
    for r in results:
        if r["server"] != "kvfuse" or not r["cache"]:
            continue
        v = vl(r["workload"], r["concurrency"])
        if v is None:
            continue
        w, c = r["workload"], r["concurrency"]
        verdict(
            f"{w} @ {c} clients: kvfuse (cache on) tokens/s >= vLLM's",
            r["output_tokens_per_s"],
            f">= {v['output_tokens_per_s']}",
            r["output_tokens_per_s"] >= v["output_tokens_per_s"],
        )
        if r["ttft_p50_ms"] is not None and v["ttft_p50_ms"] is not None:
            verdict(
                f"{w} @ {c} clients: kvfuse (cache on) TTFT p50 <= vLLM's",
                r["ttft_p50_ms"],
                f"<= {v['ttft_p50_ms']}",
                r["ttft_p50_ms"] <= v["ttft_p50_ms"],
            )
    return {"scaling": scaling, "kvfuse_vs_vllm": versus, "targets": targets}


def _f(v, unit: str = "", nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}{unit}"


def print_results(results: list[dict]) -> None:
    head = (
        f"{'server':<30}{'workload':<14}{'clients':>8}{'reqs':>6}{'err':>5}{'req/s':>8}{'tok/s':>8}"
        f"{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>9}{'ITL p95':>9}{'prompt':>8}{'cached':>8}{'out':>6}{'exact':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['label']:<30}{r['workload']:<14}{r['concurrency']:>8}{r['requests']:>6}{r['errors']:>5}"
            f"{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>8.1f}{_f(r['ttft_p50_ms'], 'ms'):>10}"
            f"{_f(r['ttft_p95_ms'], 'ms'):>10}{_f(r['itl_p50_ms'], 'ms'):>9}{_f(r['itl_p95_ms'], 'ms'):>9}"
            f"{_f(r['mean_prompt_tokens']):>8}{_f(r['mean_cached_tokens']):>8}{_f(r['mean_output_tokens']):>6}"
            f"{r['exact_n'] or '-':>8}"
        )


def print_ratios(tables: dict) -> None:
    if tables["scaling"]:
        print("\ntokens/s at N clients / at 1 client (same server, same cache mode)")
        rows: dict[tuple, dict] = {}
        for s in tables["scaling"]:
            rows.setdefault((s["label"], s["workload"]), {})[s["clients"]] = s["x_vs_1_client"]
        levels = sorted({s["clients"] for s in tables["scaling"]})
        print(f"{'server':<30}{'workload':<14}" + "".join(f"{c:>8}" for c in levels))
        for (label, w), xs in rows.items():
            print(f"{label:<30}{w:<14}" + "".join(f"{_f(xs.get(c), 'x', 2):>8}" for c in levels))
    if tables["kvfuse_vs_vllm"]:
        print(
            "\nkvfuse / vLLM CPU (prefix caching on): tokens/s ratio (>1: kvfuse faster), "
            "TTFT p50 ratio (<1: kvfuse sooner)"
        )
        print(
            f"{'kvfuse':<20}{'workload':<14}{'clients':>8}{'tok/s':>10}{'vLLM tok/s':>12}{'ratio':>8}"
            f"{'TTFT p50':>10}{'vLLM TTFT':>11}{'ratio':>8}{'same out':>10}"
        )
        for v in tables["kvfuse_vs_vllm"]:
            print(
                f"{v['label']:<20}{v['workload']:<14}{v['clients']:>8}{v['kvfuse_tokens_per_s']:>10.1f}"
                f"{v['vllm_tokens_per_s']:>12.1f}{_f(v['tokens_per_s_ratio'], '', 2):>8}"
                f"{_f(v['kvfuse_ttft_p50_ms'], 'ms'):>10}{_f(v['vllm_ttft_p50_ms'], 'ms'):>11}"
                f"{_f(v['ttft_p50_ratio'], '', 2):>8}{v['same_outputs'] or '-':>10}"
            )
    if tables["targets"]:
        print("\ntargets (SmolLM2, this CPU)")
        for t in tables["targets"]:
            mark = {True: "MET", False: "not met", None: "?"}[t["met"]]
            print(f"  [{mark:>7}] {t['target']}: {t['value']} (goal {t['goal']})")


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    if not workloads:
        return
    series = sorted(
        {(r["server"], r["cache"], r["label"]) for r in results},
        key=lambda s: (s[0] != "kvfuse", not s[1]),
    )
    styles = {
        ("kvfuse", True): ("-o", "tab:blue"),
        ("kvfuse", False): ("--s", "tab:cyan"),
        ("vllm", True): ("-^", "tab:red"),
    }
    levels = sorted({r["concurrency"] for r in results})
    cols = (
        ("output_tokens_per_s", "output tokens/s", "tokens/s", False),
        ("ttft_p50_ms", "TTFT p50 (client-side)", "ms", True),
        ("itl_p50_ms", "inter-token latency p50", "ms", False),
    )
    fig, axes = plt.subplots(
        len(workloads), len(cols), figsize=(15, 3.8 * len(workloads)), squeeze=False
    )
    for row, w in enumerate(workloads):
        for server, cache, label in series:
            rs = sorted(
                (
                    r
                    for r in results
                    if r["workload"] == w and r["server"] == server and r["cache"] == cache
                ),
                key=lambda r: r["concurrency"],
            )
            if not rs:
                continue
            style, color = styles.get((server, cache), ("-x", None))
            for col, (metric, _, _, _) in enumerate(cols):
                pts = [(r["concurrency"], r[metric]) for r in rs if r[metric] is not None]
                axes[row][col].plot(
                    [p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label
                )
        for col, (_, name, unit, logy) in enumerate(cols):
            ax = axes[row][col]
            ax.set(title=f"{w}: {name}", ylabel=unit, xlabel="concurrent clients")
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off() if not logy else None
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------- main


def build_workloads(args, names: list[str]) -> list[Workload]:
    q = args.quick
    out = []
    for name in names:
        if name == "shared-prefix":
            examples = load_dev(args.data)
            reqs = shared_prefix_requests(
                examples,
                args.doc_sets or (2 if q else 4),
                args.questions or (2 if q else 4),
                args.doc_words or (300 if q else 600),
            )
            out.append(
                Workload(
                    name,
                    reqs,
                    args.max_tokens or (4 if q else 8),
                    f"MuSiQue dev (examples 0-49 of {args.data.name})",
                )
            )
        elif name == "chat":
            examples = load_dev(args.data)
            reqs = chat_requests(
                examples, args.conversations or (2 if q else 16), args.turns, args.chat_doc_words
            )
            out.append(
                Workload(
                    name,
                    reqs,
                    args.max_tokens or (4 if q else 8),
                    f"MuSiQue dev (examples 0-49 of {args.data.name})",
                )
            )
        elif name == "sharegpt":
            reqs = sharegpt_requests(
                args.sharegpt, args.sharegpt_prompts or (4 if q else 32), args.sharegpt_chars
            )
            out.append(
                Workload(
                    name,
                    reqs,
                    args.sharegpt_max_tokens or (8 if q else 48),
                    f"{args.sharegpt.name} (dev file): first user message of the first "
                    f"{len(reqs)} conversations, cut to {args.sharegpt_chars} characters",
                )
            )
        elif name == "long-answer":
            reqs = long_answer_requests(args.long_prompts or (2 if q else 16))
            out.append(
                Workload(
                    name,
                    reqs,
                    args.long_max_tokens or (16 if q else 128),
                    "one-sentence prompts asking for long explanations (bench/serve.py)",
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run of the plumbing: few requests, clients 1 and 4",
    )
    p.add_argument(
        "--servers", default="kvfuse,vllm", help="comma-separated, run in this order: kvfuse, vllm"
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    p.add_argument(
        "--clients",
        "--concurrency",
        dest="clients",
        type=int,
        nargs="+",
        help="concurrent client counts (default 1 4 16 32; quick: 1 4). 1 is always run first: the "
        "exactness reference",
    )
    p.add_argument(
        "--cache", choices=("both", "on", "off"), default="both", help="kvfuse cache modes to run"
    )
    p.add_argument("--data", type=Path, default=DATA / "musique_s.json")
    p.add_argument("--sharegpt", type=Path, default=DATA / "sharegpt_multiturn_dev.jsonl")
    p.add_argument(
        "--home", default=os.environ.get("KVFUSE_HOME") or str(Path.home() / ".cache" / "kvfuse")
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="tokens per answer of shared-prefix and chat (default 8; quick: 4)",
    )
    p.add_argument(
        "--doc-words",
        type=int,
        help="words of documents per shared-prefix prompt (default 600, "
        "~800 tokens: 3 shared 256-token chunks; quick: 300)",
    )
    p.add_argument(
        "--doc-sets",
        type=int,
        help="document sets of the shared-prefix workload (default 4; quick: 2)",
    )
    p.add_argument("--questions", type=int, help="questions per document set (default 4; quick: 2)")
    p.add_argument(
        "--conversations", type=int, help="chat conversations per run (default 16; quick: 2)"
    )
    p.add_argument("--turns", type=int, default=2, help="user turns per conversation (default 2)")
    p.add_argument(
        "--chat-doc-words",
        type=int,
        default=180,
        help="words of the document in a chat's system message (default 180: a first turn of ~300 tokens)",
    )
    p.add_argument("--sharegpt-prompts", type=int, help="sharegpt requests (default 32; quick: 4)")
    p.add_argument(
        "--sharegpt-chars",
        type=int,
        default=400,
        help="characters of each first message (default 400)",
    )
    p.add_argument(
        "--sharegpt-max-tokens", type=int, help="tokens per sharegpt answer (default 48; quick: 8)"
    )
    p.add_argument(
        "--long-prompts",
        type=int,
        help=f"long-answer requests (default 16, at most {len(LONG_ANSWER_PROMPTS)}; quick: 2)",
    )
    p.add_argument(
        "--long-max-tokens", type=int, help="tokens per long answer (default 128; quick: 16)"
    )
    p.add_argument(
        "--ignore-eos",
        choices=("auto", "on", "off"),
        default="auto",
        help="send ignore_eos: auto = only if every server accepts it (kvfuse's schema has the field)",
    )
    p.add_argument(
        "--disk",
        action="store_true",
        help="kvfuse: add the disk tier (a temp directory) to the memory tier",
    )
    p.add_argument(
        "--kvfuse-config",
        type=Path,
        metavar="YAML",
        help="kvfuse: a config file merged over the benchmark's settings (e.g. engine batching keys)",
    )
    p.add_argument(
        "--kvfuse-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="kvfuse: extra `kvfuse serve` flags, shell-split, repeatable; write --kvfuse-arg='--threads 2'",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="vLLM's venv python (default .baselines/vllm-venv/bin/python or $KVFUSE_VLLM_PYTHON)",
    )
    p.add_argument(
        "--vllm-model-path",
        type=Path,
        help="the HF folder vLLM serves (default <home>/models/<model>)",
    )
    p.add_argument(
        "--vllm-kv-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4)"
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="vLLM: extra api_server flags, shell-split, repeatable",
    )
    p.add_argument(
        "--vllm-setup",
        choices=("tuned", "default"),
        default="tuned",
        help="vLLM CPU set-up: tuned (default; its CPU guide: tcmalloc and Intel OpenMP "
        "preloaded, no core reserved for HTTP: bench/vllm_server.tuned_env) or default (as installed)",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vLLM: extra environment, repeatable, over --vllm-setup's (as installed, vLLM CPU "
        "reserves one of the 2 cores for its API server and computes on the other)",
    )
    p.add_argument("--tag", help="output name docs/bench/serve-TAG.{json,png}")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvfuse-bench-serve",
        help="server logs (default: $TMPDIR/kvfuse-bench-serve)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="output prefix (default docs/bench/serve; quick: docs/bench/serve-quick)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the existing output's results of the (server, workload) "
        "pairs this run does not redo",
    )
    args = p.parse_args(argv)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for s in servers:
        if s not in SERVERS:
            p.error(f"unknown server {s!r}: choose from {', '.join(SERVERS)}")
    for w in names:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
    clients = sorted(set(args.clients or ([1, 4] if args.quick else [1, 4, 16, 32])))
    if clients[0] != 1:
        print("note: no 1-client run, so no exactness and no scaling ratios", file=sys.stderr)
    cache_modes = {"both": [False, True], "on": [True], "off": [False]}[args.cache]
    name = f"serve-{args.tag}" if args.tag else "serve-quick" if args.quick else "serve"
    out = args.out or REPO / "docs" / "bench" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)

    kvfuse_eos = kvfuse_accepts_ignore_eos()
    ignore_eos = {"on": True, "off": False, "auto": kvfuse_eos}[args.ignore_eos]
    workloads = build_workloads(args, names)
    for wl in workloads:
        print(
            f"{wl.name}: {len(wl.requests)} request streams, max_tokens {wl.max_tokens}; data: {wl.source}",
            file=sys.stderr,
        )
    print(
        "splits: MuSiQue dev (0-49) and the ShareGPT dev file only; no test data is used",
        file=sys.stderr,
    )

    # Earlier results kept with --merge; this run replaces every (server, workload) pair it runs.
    kept: list[dict] = []
    kept_outputs: dict = {}
    earlier_meta: list[dict] = []
    json_path = Path(f"{out}.json")
    if args.merge and json_path.is_file():
        old = json.loads(json_path.read_text())
        redo = {(s, w.name) for s in servers for w in workloads}
        kept = [r for r in old.get("results", []) if (r["server"], r["workload"]) not in redo]
        kept_keys = {(r["label"], r["workload"], r["concurrency"]) for r in kept}
        kept_outputs = {
            k: v
            for k, v in old.get("outputs", {}).items()
            if tuple(k.split("|")[:2] + [int(k.split("|")[2])]) in kept_keys
        }
        if kept:  # the settings those results were measured with
            earlier_meta = [
                {k: v for k, v in old["meta"].items() if k != "earlier_runs"},
                *old["meta"].get("earlier_runs", []),
            ]

    meta = {
        "mode": "quick" if args.quick else "full",
        "model": args.model,
        "servers": servers,
        "workloads": {
            wl.name: {"requests": len(wl.requests), "max_tokens": wl.max_tokens, "data": wl.source}
            for wl in workloads
        },
        "clients": clients,
        "kvfuse_cache_modes": ["on" if c else "off" for c in cache_modes],
        "sampling": "greedy (temperature 0), streamed with stream_options.include_usage",
        "ignore_eos": ignore_eos,
        "kvfuse_accepts_ignore_eos": kvfuse_eos,
        "output_tokens": "usage.completion_tokens of the last stream chunk (tokens actually generated)",
        "ttft": "client-side, request sent -> first streamed chunk with content",
        "itl": "client-side gaps between consecutive content chunks after the first, pooled over a run's requests",
        "exact": "fraction of outputs identical to the same server's (same cache mode) 1-client run",
        "cache_off": "kvfuse: per-request cache: false, same server process",
        "cache_on": "kvfuse and vLLM: a fresh cache_salt per run (each run starts cold)",
        "tiers": "memory+disk" if args.disk else "memory",
        "vllm_reference": VLLM_REFERENCE,
        "cpu_count": os.cpu_count(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["bench/serve.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    if earlier_meta:
        meta["earlier_runs"] = earlier_meta  # --merge: the meta of the runs whose results were kept
    results: list[dict] = []
    outputs: dict[str, dict[str, str]] = {}  # "label|workload|clients" -> request key -> text
    failures: list[str] = []
    t_start = time.perf_counter()

    def save() -> None:
        all_results = kept + results
        all_outputs = {**kept_outputs, **outputs}
        tables = ratio_tables(all_results, all_outputs)
        meta["total_s"] = round(time.perf_counter() - t_start, 1)
        meta["failures"] = failures
        json_path.write_text(
            json.dumps(
                {"meta": meta, "results": all_results, **tables, "outputs": all_outputs}, indent=1
            )
        )

    def run_server(server: str, runner: Runner, modes: list[bool]) -> None:
        warm_up(runner, max(clients))
        for wl in workloads:
            one_client: dict[bool, dict[str, str]] = {}
            for c in clients:
                for cache_on in modes:
                    label = labels(server, cache_on)
                    salt = f"bench-{server}-{wl.name}-{c}-{cache_on}-{time.time_ns()}"
                    r, texts = runner.run(wl, c, cache_on, salt, label)
                    if c == 1:
                        one_client[cache_on] = texts
                    ref = one_client.get(cache_on)
                    if ref is not None:
                        same = [texts[k] == ref[k] for k in texts if k in ref]
                        r.exact = round(sum(same) / len(same), 3) if same else None
                        r.exact_n = f"{sum(same)}/{len(same)}"
                    results.append(asdict(r))
                    outputs[f"{label}|{wl.name}|{c}"] = texts
                    print(
                        f"  {label:<30} {wl.name:<14} clients={c:<3} {r.requests} requests, {r.errors} errors, "
                        f"{r.wall_s:.1f} s, {r.output_tokens_per_s:.1f} tok/s, TTFT p50 {_f(r.ttft_p50_ms, ' ms')}, "
                        f"exact {r.exact_n or '-'}",
                        file=sys.stderr,
                    )
                    if r.error_samples:
                        print(f"    errors: {r.error_samples}", file=sys.stderr)
            save()

    for server in servers:
        t0 = time.perf_counter()
        try:
            if server == "kvfuse":
                ensure_model(args.home, args.model)
                tmp = tempfile.TemporaryDirectory(prefix="kvfuse-bench-serve-")
                config = {
                    "model": args.model,
                    "cache": {"disk": args.disk, "disk_path": str(Path(tmp.name) / "kv")},
                    "server": {"max_queue": 256, "max_tokens_limit": 1024},
                }
                if args.kvfuse_config:
                    config = deep_merge(
                        config, yaml.safe_load(args.kvfuse_config.read_text()) or {}
                    )
                extra_args = [a for s in args.kvfuse_arg for a in shlex.split(s)]
                meta["kvfuse_config"], meta["kvfuse_args"] = config, extra_args
                log = args.log_dir / f"{out.name}-kvfuse.log"
                with ServerProcess(args.home, config=config, args=extra_args, log_path=log) as srv:
                    meta["kvfuse_startup_s"] = round(time.perf_counter() - t0, 1)
                    print(
                        f"kvfuse serve up in {meta['kvfuse_startup_s']} s (pid {srv.pid}, log {log})",
                        file=sys.stderr,
                    )
                    run_server(
                        "kvfuse",
                        Runner(srv.base_url, args.model, "kvfuse", ignore_eos),
                        cache_modes,
                    )
                tmp.cleanup()
            else:
                from vllm_server import DEFAULT_PYTHON, VLLMServer, default_model_path, tuned_env

                model_path = args.vllm_model_path or default_model_path(args.home, args.model)
                extra_args = [
                    "--enable-prompt-tokens-details",
                    *(a for s in args.vllm_arg for a in shlex.split(s)),
                ]
                log = args.log_dir / f"{out.name}-vllm.log"
                env = {
                    **(
                        tuned_env(args.vllm_python or DEFAULT_PYTHON)
                        if args.vllm_setup == "tuned"
                        else {}
                    ),
                    **dict(kv.split("=", 1) for kv in args.vllm_env),
                }
                srv = VLLMServer(
                    model_path,
                    args.model,
                    python=args.vllm_python or DEFAULT_PYTHON,
                    kv_cache_gib=args.vllm_kv_gib,
                    extra_args=extra_args,
                    env=env,
                    log_path=log,
                )
                meta["vllm_command"] = " ".join(srv.cmd)
                meta["vllm_env"] = {
                    "VLLM_CPU_KVCACHE_SPACE": srv.env["VLLM_CPU_KVCACHE_SPACE"],
                    **env,
                }
                print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
                with srv:
                    meta["vllm_startup_s"] = round(srv.startup_s, 1)
                    meta["vllm_cpu_binding"] = [
                        ln.split("]", 1)[-1].strip()
                        for ln in srv.log_tail(1_000_000).splitlines()
                        if "core ids=" in ln or "reserved_cpus=" in ln or "Torch threads" in ln
                    ]
                    meta["vllm_prefix_caching"] = srv.log_has(
                        "'enable_prefix_caching': True"
                    ) or srv.log_has("enable_prefix_caching=True")
                    accepts = server_accepts(srv.url, "ignore_eos")
                    meta["vllm_accepts_ignore_eos"] = accepts
                    if ignore_eos and accepts is False:
                        raise RuntimeError(
                            "vLLM's schema has no ignore_eos; rerun with --ignore-eos off"
                        )
                    print(f"vLLM up in {srv.startup_s:.0f} s (pid {srv.proc.pid})", file=sys.stderr)
                    run_server("vllm", Runner(srv.base_url, args.model, "vllm", ignore_eos), [True])
        except Exception as e:  # keep what the other servers measured
            failures.append(f"{server}: {type(e).__name__}: {e}"[:2000])
            print(f"{server} failed: {e}", file=sys.stderr)
        save()

    all_results = kept + results
    tables = ratio_tables(all_results, {**kept_outputs, **outputs})
    print_results(all_results)
    print_ratios(tables)
    title = f"{args.model} on {os.cpu_count()} CPU cores: kvfuse vs vLLM CPU, {meta['mode']} run"
    plot(all_results, Path(f"{out}.png"), title)
    print(f"wrote {json_path} and {out}.png ({meta['total_s']:.0f} s)", file=sys.stderr)
    return 1 if failures or any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
