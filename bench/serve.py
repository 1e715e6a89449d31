"""Serving benchmark: concurrent OpenAI-API clients against a real ``kvfuse serve`` process, and
against vLLM's CPU build and llama.cpp's ``llama-server`` on the same model and workloads in the
same run.

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

Servers (``--servers`` or ``--engines``, default ``kvfuse,vllm``; add ``llama.cpp``), one after the
other, never two at once (bench/lib/servers.py):

- ``kvfuse``: a ``kvfuse serve`` child process (``kvfuse_testkit.ServerProcess``), cache on and off
  in the same process: ``"cache": false`` per request for the off runs (the engine then skips
  lookup, load and store entirely, the code path of a server without a cache). Every cache-on run
  uses its own ``cache_salt`` so that it starts cold and profits only from reuse within the run.
  ``--kvfuse-config FILE`` (YAML, merged over the benchmark's own settings) and ``--kvfuse-arg``
  (extra ``kvfuse serve`` flags) configure it, e.g. the engine's batching settings.
- ``vllm``: vLLM's CPU build (``bench/lib/vllm.py``; venv from ``bench/setup_vllm.sh``) on the
  very same HF folder (``$KVFUSE_HOME/models/smollm2``), float32, its prefix caching on
  (``--enable-prefix-caching``), run once per workload and client count, labelled "prefix caching
  on". Every run sends its own ``cache_salt`` too (vLLM honours it), so it also starts cold.
- ``llama.cpp``: llama.cpp's own server (``bench/lib/llama_server.py``; binary from
  ``bash bench/setup_llama_server.sh``) on the model's GGUF as F32 (``--llama-gguf``; the very
  weights kvfuse and vLLM serve), labelled "prompt cache on", started as

      llama-server --model <smollm2 F32 gguf> --alias smollm2 --host 127.0.0.1 --port P
          --threads N --threads-batch N --ctx-size C --parallel K --kv-unified
          --cache-prompt --cache-reuse 256 --metrics --no-webui

  N = ``--llama-threads`` (default: all cores, the threads kvfuse and vLLM use); K = the largest
  client count (a slot per client); C = ``--vllm-kv-gib`` of f16 KV in tokens (the KV RAM vLLM
  gets), shared by all slots. Its prompt cache (slots, ``--cache-reuse`` chunks, the host-RAM
  cache) stays at llama.cpp's defaults. It honours no ``cache_salt``, so every run gets a fresh
  server (a cold cache), warmed up as the others were.

Every request is greedy (temperature 0) and streamed (``stream_options={"include_usage": True}``)
through the official ``openai`` client. ``ignore_eos`` (``--ignore-eos auto``) is sent only when
every server accepts it (vLLM and llama-server do; kvfuse's request schema has it), so every answer has exactly
``max_tokens`` tokens; output-token counts are what was generated (``usage.completion_tokens`` of
the last chunk).

Metrics per (server, cache, workload, clients) run, all client-side: requests/s and output
tokens/s (completed requests and summed ``completion_tokens`` / wall time of the run); TTFT p50/p95
(request sent -> first chunk with content); inter-token latency p50/p95 (gaps between consecutive
content chunks after the first, pooled over the run's requests); errors; ``exact``: the fraction of
outputs identical to the same server's (and cache mode's) 1-client run. Tables: tokens/s at N
clients / at 1 client per server, kvfuse / vLLM (and kvfuse / llama.cpp) per workload and client
count (tokens/s and TTFT p50, and how many outputs agree), and the issue's targets with a verdict.

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

import datetime as _dt
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.lib import servers as srvs
from bench.lib.cli import add_common, csv, parser
from bench.lib.client import (
    Pass,
    Request,
    Runner,
    Workload,
    kvfuse_accepts_ignore_eos,
    percentile,
    warm_up,
)
from bench.lib.client import rounded as _r
from bench.lib.paths import DATA, MUSIQUE_DEV
from bench.lib.results import pyplot, save_figure, stem, write_json

DEV = MUSIQUE_DEV  # musique_s.json: 0-49 dev, 50-149 test (never used here)
SYSTEM = "Answer the question using the documents. Reply with a short answer only."
WORKLOADS = ("shared-prefix", "chat", "sharegpt", "long-answer")
SERVERS = srvs.ENGINES
OTHERS = {"vllm": "vllm", "llama.cpp": "llama_cpp"}  # compared with kvfuse: JSON key prefixes
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
            prompt = f"{SYSTEM}\n\n{docs}\n\nQuestion: {question}\nAnswer:"
            reqs.append(Request(f"set{i}/q{q}", prompt=prompt))
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
        reqs.append(Request(f"conv{c}", conversation=asks, system=f"{SYSTEM}\n\n{doc}"))
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
            messages = [{"role": "user", "content": first["content"][:chars]}]
            reqs.append(Request(f"{conv['id']}", messages=messages))
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


def build_workloads(args, names: list[str]) -> list[Workload]:
    builders = {
        "shared-prefix": _shared_prefix,
        "chat": _chat,
        "sharegpt": _sharegpt,
        "long-answer": _long_answer,
    }
    return [builders[name](args, args.quick) for name in names]


def _musique_source(args) -> str:
    return f"MuSiQue dev (examples 0-49 of {args.data.name})"


def _shared_prefix(args, q: bool) -> Workload:
    reqs = shared_prefix_requests(
        load_dev(args.data),
        args.doc_sets or (2 if q else 4),
        args.questions or (2 if q else 4),
        args.doc_words or (300 if q else 600),
    )
    return Workload(
        "shared-prefix", reqs, args.max_tokens or (4 if q else 8), _musique_source(args)
    )


def _chat(args, q: bool) -> Workload:
    reqs = chat_requests(
        load_dev(args.data), args.conversations or (2 if q else 16), args.turns, args.chat_doc_words
    )
    return Workload("chat", reqs, args.max_tokens or (4 if q else 8), _musique_source(args))


def _sharegpt(args, q: bool) -> Workload:
    reqs = sharegpt_requests(
        args.sharegpt, args.sharegpt_prompts or (4 if q else 32), args.sharegpt_chars
    )
    source = (
        f"{args.sharegpt.name} (dev file): first user message of the first "
        f"{len(reqs)} conversations, cut to {args.sharegpt_chars} characters"
    )
    return Workload("sharegpt", reqs, args.sharegpt_max_tokens or (8 if q else 48), source)


def _long_answer(args, q: bool) -> Workload:
    reqs = long_answer_requests(args.long_prompts or (2 if q else 16))
    source = "one-sentence prompts asking for long explanations (bench/serve.py)"
    return Workload("long-answer", reqs, args.long_max_tokens or (16 if q else 128), source)


# -------------------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    server: str  # kvfuse | vllm | llama.cpp
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


def _mean(xs: list) -> float | None:
    return _r(statistics.fmean(xs)) if xs else None


def run_result(
    server: str, cache: bool, label: str, wl: Workload, concurrency: int, p: Pass
) -> RunResult:
    """One pass's statistics: rates over its wall time, TTFT / ITL / latency percentiles (ms)."""
    s, wall = p.samples, p.wall_s
    ttft = [x["ttft"] * 1000 for x in s]
    itl = [g * 1000 for x in s for g in x["itl"]]
    prompt = [x["prompt_tokens"] for x in s if x["prompt_tokens"] is not None]
    cached = [x["cached"] for x in s if x["cached"] is not None]
    out_tokens = [x["completion_tokens"] for x in s]
    return RunResult(
        *(server, cache, label, wl.name, concurrency, len(wl.requests), len(s), len(p.errors)),
        round(wall, 2),
        round(len(s) / wall, 3),
        sum(out_tokens),
        round(sum(out_tokens) / wall, 2),
        *(_r(percentile(ttft, 0.5)), _r(percentile(ttft, 0.95))),
        *(_r(percentile(itl, 0.5)), _r(percentile(itl, 0.95))),
        _r(percentile([x["latency"] * 1000 for x in s], 0.5)),
        *(_mean(prompt), _mean(cached), _mean(out_tokens)),
        ran_at=p.ran_at,
        error_samples=p.errors[:3],
    )


def labels(server: str, cache: bool) -> str:
    if server in srvs.LABELS:
        return srvs.LABELS[server]
    return f"kvfuse cache {'on' if cache else 'off'}"


# -------------------------------------------------------------------------------- the bench


class Bench:
    """One invocation: the workloads, the runs done so far (and kept ones with ``--merge``), the
    JSON rewritten after every workload."""

    def __init__(self, args, argv, servers: list[str], workloads: list[Workload]):
        self.args, self.servers, self.workloads = args, servers, workloads
        self.clients = sorted(set(args.clients or ([1, 4] if args.quick else [1, 4, 16, 32])))
        self.modes = {"both": [False, True], "on": [True], "off": [False]}[args.cache]
        self.name = stem(args.out).name if args.out else _name(args)
        self.out = stem(args.out) if args.out else stem(self.name)
        self.json_path = Path(f"{self.out}.json")
        self.results: list[dict] = []
        self.outputs: dict[str, dict[str, str]] = {}  # "label|workload|clients" -> key -> text
        self.failures: list[str] = []
        self.kept, self.kept_outputs, earlier = self.load_kept() if args.merge else ([], {}, [])
        self.kvfuse_eos = kvfuse_accepts_ignore_eos()
        self.ignore_eos = {"on": True, "off": False, "auto": self.kvfuse_eos}[args.ignore_eos]
        self.meta = self.describe(argv)
        if earlier:
            self.meta["earlier_runs"] = (
                earlier  # --merge: the meta of the runs whose results were kept
            )
        self.t_start = time.perf_counter()

    def load_kept(self) -> tuple[list[dict], dict, list[dict]]:
        """``--merge``: the existing output's results of (server, workload) pairs not redone."""
        if not self.json_path.is_file():
            return [], {}, []
        old = json.loads(self.json_path.read_text())
        redo = {(s, w.name) for s in self.servers for w in self.workloads}
        kept = [r for r in old.get("results", []) if (r["server"], r["workload"]) not in redo]
        keys = {(r["label"], r["workload"], r["concurrency"]) for r in kept}
        outputs = {
            k: v
            for k, v in old.get("outputs", {}).items()
            if tuple(k.split("|")[:2] + [int(k.split("|")[2])]) in keys
        }
        if not kept:
            return [], outputs, []
        meta = old["meta"]  # the settings those results were measured with
        earlier = [{k: v for k, v in meta.items() if k != "earlier_runs"}]
        return kept, outputs, earlier + meta.get("earlier_runs", [])

    def describe(self, argv) -> dict:
        a = self.args
        return {
            "mode": "quick" if a.quick else "full",
            "model": a.model,
            "servers": self.servers,
            "workloads": {
                wl.name: {
                    "requests": len(wl.requests),
                    "max_tokens": wl.max_tokens,
                    "data": wl.source,
                }
                for wl in self.workloads
            },
            "clients": self.clients,
            "kvfuse_cache_modes": ["on" if c else "off" for c in self.modes],
            "sampling": "greedy (temperature 0), streamed with stream_options.include_usage",
            "ignore_eos": self.ignore_eos,
            "kvfuse_accepts_ignore_eos": self.kvfuse_eos,
            "output_tokens": "usage.completion_tokens of the last stream chunk (tokens actually generated)",
            "ttft": "client-side, request sent -> first streamed chunk with content",
            "itl": "client-side gaps between consecutive content chunks after the first, pooled over a run's requests",
            "exact": "fraction of outputs identical to the same server's (same cache mode) 1-client run",
            "cache_off": "kvfuse: per-request cache: false, same server process",
            "cache_on": "kvfuse and vLLM: a fresh cache_salt per run (each run starts cold)"
            + ("; llama.cpp: a fresh server per run" if "llama.cpp" in self.servers else ""),
            "tiers": "memory+disk" if a.disk else "memory",
            "vllm_reference": VLLM_REFERENCE,
            "cpu_count": os.cpu_count(),
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["bench/serve.py", *(argv if argv is not None else sys.argv[1:])]),
        }

    def all_results(self) -> tuple[list[dict], dict]:
        return self.kept + self.results, {**self.kept_outputs, **self.outputs}

    def save(self) -> None:
        results, outputs = self.all_results()
        tables = ratio_tables(results, outputs)
        self.meta["total_s"] = round(time.perf_counter() - self.t_start, 1)
        self.meta["failures"] = self.failures
        payload = {"meta": self.meta, "results": results, **tables, "outputs": outputs}
        write_json(self.json_path, payload, add_environment=False, indent=1)

    def run_server(self, server: str, runner: Runner, modes: list[bool], fresh=None) -> None:
        """Every workload at every client count and cache mode; ``fresh`` (llama.cpp) gives a
        new, warmed-up runner before each run, else one warm-up first."""
        if fresh is None:
            warm_up(runner, max(self.clients))
        for wl in self.workloads:
            one_client: dict[bool, dict[str, str]] = {}
            for c in self.clients:
                for cache_on in modes:
                    runner = fresh() if fresh is not None else runner
                    self.run_one(server, runner, wl, c, cache_on, one_client)
            self.save()

    def run_one(self, server, runner, wl: Workload, c: int, cache_on: bool, one_client) -> None:
        label = labels(server, cache_on)
        salt = f"bench-{server}-{wl.name}-{c}-{cache_on}-{time.time_ns()}"
        p = runner.run(wl, c, runner.extra(cache_on, salt))
        r, texts = run_result(server, cache_on, label, wl, c, p), p.outputs
        if c == 1:
            one_client[cache_on] = texts
        ref = one_client.get(cache_on)
        if ref is not None:
            same = [texts[k] == ref[k] for k in texts if k in ref]
            r.exact = round(sum(same) / len(same), 3) if same else None
            r.exact_n = f"{sum(same)}/{len(same)}"
        self.results.append(asdict(r))
        self.outputs[f"{label}|{wl.name}|{c}"] = texts
        print(
            f"  {label:<30} {wl.name:<14} clients={c:<3} {r.requests} requests, {r.errors} errors, "
            f"{r.wall_s:.1f} s, {r.output_tokens_per_s:.1f} tok/s, TTFT p50 {_f(r.ttft_p50_ms, ' ms')}, "
            f"exact {r.exact_n or '-'}",
            file=sys.stderr,
        )
        if r.error_samples:
            print(f"    errors: {r.error_samples}", file=sys.stderr)

    def run_kvfuse(self) -> None:
        import tempfile

        a, t0 = self.args, time.perf_counter()
        log = srvs.log_path(a, self.name, "kvfuse")
        with tempfile.TemporaryDirectory(prefix="kvfuse-bench-serve-") as tmp:
            config = {
                "model": a.model,
                "cache": {"disk": a.disk, "disk_path": str(Path(tmp) / "kv")},
                "server": {"max_queue": 256, "max_tokens_limit": 1024},
            }
            with srvs.kvfuse_process(a, config, log, self.meta) as srv:
                self.meta["kvfuse_startup_s"] = round(time.perf_counter() - t0, 1)
                print(
                    f"kvfuse serve up in {self.meta['kvfuse_startup_s']} s (pid {srv.pid}, log {log})",
                    file=sys.stderr,
                )
                runner = Runner(srv.base_url, a.model, "kvfuse", self.ignore_eos)
                self.run_server("kvfuse", runner, self.modes)

    def run_vllm(self) -> None:
        a = self.args
        log = srvs.log_path(a, self.name, "vllm")
        srv, env = srvs.vllm_process(a, ["--enable-prompt-tokens-details"], log, a.vllm_kv_gib)
        self.meta["vllm_command"] = " ".join(srv.cmd)
        self.meta["vllm_env"] = {"VLLM_CPU_KVCACHE_SPACE": srv.env["VLLM_CPU_KVCACHE_SPACE"], **env}
        print(f"starting vLLM (~4 min; log {log})", file=sys.stderr)
        with srv:
            m = self.meta
            m["vllm_startup_s"] = round(srv.startup_s, 1)
            m["vllm_cpu_binding"] = srv.log_lines(
                "core ids=", "reserved_cpus=", "Torch threads", chars=1_000_000, width=None
            )
            m["vllm_prefix_caching"] = srv.prefix_caching_logged()
            m["vllm_accepts_ignore_eos"] = srvs.require_ignore_eos(srv.url, self.ignore_eos, "vLLM")
            print(f"vLLM up in {srv.startup_s:.0f} s (pid {srv.pid})", file=sys.stderr)
            runner = Runner(srv.base_url, a.model, "vllm", self.ignore_eos)
            self.run_server("vllm", runner, [True])

    def run_llama(self) -> None:
        a = self.args
        model_dir = srvs.model_folder(a.home, a.model)
        ctx = int(a.vllm_kv_gib * 2**30) // srvs.kv_bytes_per_token(model_dir, 2)
        srv = srvs.llama_process(
            a, ctx, max(self.clients), srvs.log_path(a, self.name, "llama.cpp")
        )
        with srv:
            srvs.llama_meta(srv, self.meta)
            self.meta["llama_accepts_ignore_eos"] = srvs.require_ignore_eos(
                srv.url, self.ignore_eos, "llama-server"
            )
            print(f"llama-server up in {srv.startup_s:.1f} s (pid {srv.pid})", file=sys.stderr)

            def fresh() -> Runner:  # no cache_salt: a new server is a cold cache
                srv.restart()
                runner = Runner(srv.base_url, a.model, "llama.cpp", self.ignore_eos)
                warm_up(runner, max(self.clients))
                srv.erase_slots()
                return runner

            self.run_server("llama.cpp", None, [True], fresh)

    def run_all(self) -> None:
        run = {"kvfuse": self.run_kvfuse, "vllm": self.run_vllm, "llama.cpp": self.run_llama}
        for server in self.servers:
            try:
                run[server]()
            except Exception as e:  # keep what the other servers measured
                self.failures.append(f"{server}: {type(e).__name__}: {e}"[:2000])
                print(f"{server} failed: {e}", file=sys.stderr)
            self.save()

    def finish(self) -> int:
        results, outputs = self.all_results()
        tables = ratio_tables(results, outputs)
        print_results(results)
        print_ratios(tables)
        others = " vs ".join(
            {"vllm": "vLLM CPU", "llama.cpp": "llama.cpp server"}[s]
            for s in self.servers
            if s != "kvfuse"
        )
        title = (
            f"{self.args.model} on {os.cpu_count()} CPU cores: kvfuse vs {others or 'vLLM CPU'}, "
            f"{self.meta['mode']} run"
        )
        plot(results, Path(f"{self.out}.png"), title)
        print(
            f"wrote {self.json_path} and {self.out}.png ({self.meta['total_s']:.0f} s)",
            file=sys.stderr,
        )
        return 1 if self.failures or any(r["errors"] for r in self.results) else 0


def _name(args) -> str:
    return f"serve-{args.tag}" if args.tag else "serve-quick" if args.quick else "serve"


# ----------------------------------------------------------------------------------- tables


def key(r: dict) -> tuple:
    return r["server"], r["cache"], r["workload"], r["concurrency"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def scaling(results: list[dict], by: dict) -> list[dict]:
    """Tokens/s at N clients / at 1 client, same server and cache mode."""
    out = []
    for r in results:
        one = by.get((r["server"], r["cache"], r["workload"], 1))
        if one and one["output_tokens_per_s"]:
            out.append(
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
    return out


def versus(results: list[dict], outputs: dict, by: dict, other: str) -> list[dict]:
    """kvfuse (each cache mode) / ``other`` (its cache on) per workload and client count: tokens/s
    and TTFT p50 ratios, and how many outputs agree. Keys: ``<prefix>_tokens_per_s`` etc., the
    prefix ``vllm`` or ``llama_cpp``."""
    pre, out = OTHERS[other], []
    for r in results:
        v = by.get((other, True, r["workload"], r["concurrency"]))
        if r["server"] != "kvfuse" or v is None:
            continue
        a = outputs.get(f"{r['label']}|{r['workload']}|{r['concurrency']}", {})
        b = outputs.get(f"{v['label']}|{v['workload']}|{v['concurrency']}", {})
        both = sorted(set(a) & set(b))
        out.append(
            {
                "label": r["label"],
                "workload": r["workload"],
                "clients": r["concurrency"],
                "kvfuse_tokens_per_s": r["output_tokens_per_s"],
                f"{pre}_tokens_per_s": v["output_tokens_per_s"],
                "tokens_per_s_ratio": _ratio(r["output_tokens_per_s"], v["output_tokens_per_s"]),
                "kvfuse_ttft_p50_ms": r["ttft_p50_ms"],
                f"{pre}_ttft_p50_ms": v["ttft_p50_ms"],
                "ttft_p50_ratio": _ratio(r["ttft_p50_ms"], v["ttft_p50_ms"]),
                "same_outputs": f"{sum(a[k] == b[k] for k in both)}/{len(both)}" if both else None,
            }
        )
    return out


def targets(results: list[dict], by: dict) -> list[dict]:
    """The issue's targets (kvfuse cache on against vLLM and the issue's figures), with verdicts."""
    out: list[dict] = []

    def verdict(name: str, value, goal, ok: bool | None) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": ok})

    s1, s16 = by.get(("kvfuse", True, "sharegpt", 1)), by.get(("kvfuse", True, "sharegpt", 16))
    if s1 and s16 and s1["output_tokens_per_s"]:
        x = round(s16["output_tokens_per_s"] / s1["output_tokens_per_s"], 2)
        verdict(
            "sharegpt: kvfuse (cache on) tokens/s at 16 clients / at 1 client", x, ">= 6", x >= 6
        )
    if s16:
        t, ref = s16["output_tokens_per_s"], VLLM_REFERENCE["clients_16"]
        name = "sharegpt: kvfuse (cache on) tokens/s at 16 clients vs the issue's vLLM CPU figure"
        verdict(name, t, f">= {ref}", t >= ref)
    for r in results:
        v = by.get(("vllm", True, r["workload"], r["concurrency"]))
        if r["server"] != "kvfuse" or not r["cache"] or v is None:
            continue
        w, c = r["workload"], r["concurrency"]
        tok, vtok = r["output_tokens_per_s"], v["output_tokens_per_s"]
        verdict(
            f"{w} @ {c} clients: kvfuse (cache on) tokens/s >= vLLM's",
            tok,
            f">= {vtok}",
            tok >= vtok,
        )
        if r["ttft_p50_ms"] is not None and v["ttft_p50_ms"] is not None:
            t, vt = r["ttft_p50_ms"], v["ttft_p50_ms"]
            verdict(
                f"{w} @ {c} clients: kvfuse (cache on) TTFT p50 <= vLLM's", t, f"<= {vt}", t <= vt
            )
    return out


def ratio_tables(results: list[dict], outputs: dict) -> dict:
    """Scaling (tokens/s at N clients / at 1) per server, kvfuse / vLLM per workload and clients,
    output agreement between servers, and the issue's targets with verdicts; kvfuse / llama.cpp
    the same way when it ran."""
    by = {key(r): r for r in results}
    tables = {
        "scaling": scaling(results, by),
        "kvfuse_vs_vllm": versus(results, outputs, by, "vllm"),
        "targets": targets(results, by),
    }
    llama = versus(results, outputs, by, "llama.cpp")
    if llama:
        tables["kvfuse_vs_llama_cpp"] = llama
    return tables


def _f(v, unit: str = "", nd: int = 0) -> str:
    return "-" if v is None else f"{v:.{nd}f}{unit}"


def print_results(results: list[dict]) -> None:
    head = (
        f"{'server':<34}{'workload':<14}{'clients':>8}{'reqs':>6}{'err':>5}{'req/s':>8}{'tok/s':>8}"
        f"{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>9}{'ITL p95':>9}{'prompt':>8}{'cached':>8}{'out':>6}{'exact':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['label']:<34}{r['workload']:<14}{r['concurrency']:>8}{r['requests']:>6}{r['errors']:>5}"
            f"{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>8.1f}{_f(r['ttft_p50_ms'], 'ms'):>10}"
            f"{_f(r['ttft_p95_ms'], 'ms'):>10}{_f(r['itl_p50_ms'], 'ms'):>9}{_f(r['itl_p95_ms'], 'ms'):>9}"
            f"{_f(r['mean_prompt_tokens']):>8}{_f(r['mean_cached_tokens']):>8}{_f(r['mean_output_tokens']):>6}"
            f"{r['exact_n'] or '-':>8}"
        )


def print_scaling(rows_in: list[dict]) -> None:
    print("\ntokens/s at N clients / at 1 client (same server, same cache mode)")
    rows: dict[tuple, dict] = {}
    for s in rows_in:
        rows.setdefault((s["label"], s["workload"]), {})[s["clients"]] = s["x_vs_1_client"]
    levels = sorted({s["clients"] for s in rows_in})
    print(f"{'server':<34}{'workload':<14}" + "".join(f"{c:>8}" for c in levels))
    for (label, w), xs in rows.items():
        print(f"{label:<34}{w:<14}" + "".join(f"{_f(xs.get(c), 'x', 2):>8}" for c in levels))


def print_versus(rows: list[dict], other: str) -> None:
    pre, name = OTHERS[other], {"vllm": "vLLM", "llama.cpp": "llama.cpp"}[other]
    print(
        f"\nkvfuse / {srvs.LABELS[other]}: tokens/s ratio (>1: kvfuse faster), "
        "TTFT p50 ratio (<1: kvfuse sooner)"
    )
    print(
        f"{'kvfuse':<20}{'workload':<14}{'clients':>8}{'tok/s':>10}{name + ' tok/s':>16}{'ratio':>8}"
        f"{'TTFT p50':>10}{name + ' TTFT':>16}{'ratio':>8}{'same out':>10}"
    )
    for v in rows:
        print(
            f"{v['label']:<20}{v['workload']:<14}{v['clients']:>8}{v['kvfuse_tokens_per_s']:>10.1f}"
            f"{v[pre + '_tokens_per_s']:>16.1f}{_f(v['tokens_per_s_ratio'], '', 2):>8}"
            f"{_f(v['kvfuse_ttft_p50_ms'], 'ms'):>10}{_f(v[pre + '_ttft_p50_ms'], 'ms'):>16}"
            f"{_f(v['ttft_p50_ratio'], '', 2):>8}{v['same_outputs'] or '-':>10}"
        )


def print_ratios(tables: dict) -> None:
    if tables["scaling"]:
        print_scaling(tables["scaling"])
    for other, pre in OTHERS.items():
        if tables.get(f"kvfuse_vs_{pre}"):
            print_versus(tables[f"kvfuse_vs_{pre}"], other)
    if tables["targets"]:
        print("\ntargets (SmolLM2, this CPU)")
        for t in tables["targets"]:
            mark = {True: "MET", False: "not met", None: "?"}[t["met"]]
            print(f"  [{mark:>7}] {t['target']}: {t['value']} (goal {t['goal']})")


# ------------------------------------------------------------------------------------ plot

STYLES = {
    ("kvfuse", True): ("-o", "tab:blue"),
    ("kvfuse", False): ("--s", "tab:cyan"),
    ("vllm", True): ("-^", "tab:red"),
    ("llama.cpp", True): ("-D", "tab:orange"),
}
COLUMNS = (
    ("output_tokens_per_s", "output tokens/s", "tokens/s", False),
    ("ttft_p50_ms", "TTFT p50 (client-side)", "ms", True),
    ("itl_p50_ms", "inter-token latency p50", "ms", False),
)


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    if not workloads:
        return
    series = sorted(
        {(r["server"], r["cache"], r["label"]) for r in results},
        key=lambda s: (s[0] != "kvfuse", not s[1]),
    )
    levels = sorted({r["concurrency"] for r in results})
    fig, axes = plt.subplots(
        len(workloads), len(COLUMNS), figsize=(15, 3.8 * len(workloads)), squeeze=False
    )
    for row, w in enumerate(workloads):
        for server, cache, label in series:
            plot_series(axes[row], results, w, server, cache, label)
        for col, (_, name, unit, logy) in enumerate(COLUMNS):
            style_axis(axes[row][col], f"{w}: {name}", unit, logy, levels)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    save_figure(fig, path)


def plot_series(axes, results: list[dict], w: str, server: str, cache: bool, label: str) -> None:
    rs = sorted(
        (
            r
            for r in results
            if r["workload"] == w and r["server"] == server and r["cache"] == cache
        ),
        key=lambda r: r["concurrency"],
    )
    style, color = STYLES.get((server, cache), ("-x", None))
    for col, (metric, _, _, _) in enumerate(COLUMNS if rs else ()):
        pts = [(r["concurrency"], r[metric]) for r in rs if r[metric] is not None]
        axes[col].plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)


def style_axis(ax, title: str, unit: str, logy: bool, levels: list[int]) -> None:
    ax.set(title=title, ylabel=unit, xlabel="concurrent clients")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off() if not logy else None
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# -------------------------------------------------------------------------------------- main


def build_parser():
    p = parser(
        __doc__, ("quick", {"help": "smoke run of the plumbing: few requests, clients 1 and 4"})
    )
    srvs.add_server_flags(p, "serve")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    add_common(
        p,
        (
            "clients",
            {
                "help": "concurrent client counts (default 1 4 16 32; quick: 1 4). 1 is always run "
                "first: the exactness reference"
            },
        ),
    )
    p.add_argument(
        "--cache", choices=("both", "on", "off"), default="both", help="kvfuse cache modes to run"
    )
    p.add_argument("--data", type=Path, default=DATA / "musique_s.json")
    p.add_argument("--sharegpt", type=Path, default=DATA / "sharegpt_multiturn_dev.jsonl")
    _workload_flags(p)
    _run_flags(p)
    return p


def _workload_flags(p) -> None:
    add = p.add_argument
    add(
        "--max-tokens",
        type=int,
        help="tokens per answer of shared-prefix and chat (default 8; quick: 4)",
    )
    add(
        "--doc-words",
        type=int,
        help="words of documents per shared-prefix prompt (default 600, "
        "~800 tokens: 3 shared 256-token chunks; quick: 300)",
    )
    add(
        "--doc-sets",
        type=int,
        help="document sets of the shared-prefix workload (default 4; quick: 2)",
    )
    add("--questions", type=int, help="questions per document set (default 4; quick: 2)")
    add("--conversations", type=int, help="chat conversations per run (default 16; quick: 2)")
    add("--turns", type=int, default=2, help="user turns per conversation (default 2)")
    add(
        "--chat-doc-words",
        type=int,
        default=180,
        help="words of the document in a chat's system message (default 180: a first turn of ~300 tokens)",
    )
    add("--sharegpt-prompts", type=int, help="sharegpt requests (default 32; quick: 4)")
    add(
        "--sharegpt-chars",
        type=int,
        default=400,
        help="characters of each first message (default 400)",
    )
    add("--sharegpt-max-tokens", type=int, help="tokens per sharegpt answer (default 48; quick: 8)")
    add(
        "--long-prompts",
        type=int,
        help=f"long-answer requests (default 16, at most {len(LONG_ANSWER_PROMPTS)}; quick: 2)",
    )
    add("--long-max-tokens", type=int, help="tokens per long answer (default 128; quick: 16)")


def _run_flags(p) -> None:
    p.add_argument(
        "--disk",
        action="store_true",
        help="kvfuse: add the disk tier (a temp directory) to the memory tier",
    )
    p.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4); llama.cpp's --ctx-size holds as much f16 KV",
    )
    add_common(
        p,
        ("tag", {"help": "output name docs/bench/serve-TAG.{json,png}"}),
        (
            "out",
            {
                "type": Path,
                "help": "output prefix (default docs/bench/serve; quick: docs/bench/serve-quick)",
            },
        ),
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the existing output's results of the (server, workload) "
        "pairs this run does not redo",
    )


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    servers = srvs.servers(p, args)
    names = csv(args.workloads)
    for w in names:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
    workloads = build_workloads(args, names)
    bench = Bench(args, argv, servers, workloads)
    if bench.clients[0] != 1:
        print("note: no 1-client run, so no exactness and no scaling ratios", file=sys.stderr)
    for wl in workloads:
        print(
            f"{wl.name}: {len(wl.requests)} request streams, max_tokens {wl.max_tokens}; data: {wl.source}",
            file=sys.stderr,
        )
    print(
        "splits: MuSiQue dev (0-49) and the ShareGPT dev file only; no test data is used",
        file=sys.stderr,
    )
    bench.run_all()
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
