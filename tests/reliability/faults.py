"""Fault injection helpers for the reliability tests: a cache-free greedy reference with the
near-tie rule, a concurrent load of official ``openai`` client requests, a TCP proxy that slows
or drops connections, a tmpfs mount, a ``kvfuse serve`` without the permission-bypassing
capabilities of root, the server's counters, and file damage.

Every process, mount and thread started here is ended by the object that started it (by PID,
never by name), also when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import torch
from kvfuse_helpers import SENTENCES

from kvfuse_testkit import ServerProcess, free_port

MODEL = "smollm2"
# a top-2 logit gap below this is within float rounding (see docs/features.md, Exactness)
NEAR_TIE = 1e-3


# ---------------------------------------------------------------------------------- prompts
def document(i: int, paragraphs: int = 5) -> str:
    """About 100 tokens per paragraph; document ``i`` has its own first line, so its chunk chain
    is its own (documents never share a 256-token chunk with each other)."""
    head = f"Report {i} of the Velmora archive, filed under drawer {i * 7 + 3}."
    return (
        head
        + "\n\n"
        + "\n\n".join(
            f"Part {p + 1}. " + " ".join(SENTENCES[(i + p + j) % len(SENTENCES)] for j in range(5))
            for p in range(paragraphs)
        )
    )


QUESTIONS = ("Who built the lighthouse?", "Where do puffins nest?", "What does the bread taste of?")


@dataclass(frozen=True)
class Job:
    """One chat request: a document and a question (greedy, ``max_tokens`` tokens, past EOS)."""

    name: str
    messages: tuple[tuple[str, str], ...]
    max_tokens: int = 8

    def body(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages]


def jobs(documents: int, questions: int = 2, paragraphs: int = 5, max_tokens: int = 8) -> list[Job]:
    """``documents`` x ``questions`` chat requests; the questions of a document share its chunks."""
    return [
        Job(
            f"d{d}q{q}",
            (("user", document(d, paragraphs) + f"\n\nQuestion: {QUESTIONS[q]}\nAnswer:"),),
            max_tokens,
        )
        for d in range(documents)
        for q in range(questions)
    ]


# ------------------------------------------------------------------------------- reference
@dataclass
class Expected:
    ids: list[int]  # the prompt's token ids (the server renders the same chat template)
    tokens: list[int]  # greedy tokens of one full prefill, no cache
    gaps: list[float]  # the top-2 logit gap at each step
    text: str


class Reference:
    """The expected greedy answers: each job's answer from the server under test with the cache
    off for that request (``cache: false``, recorded by ``cache_free``), before any fault.

    An answer that differs from it is checked against a full prefill without any cache, computed
    here (the model's single-sequence path, KV in float16 as the server keeps it): it passes only
    if it first differs from that at a near-tie, a top-2 logit gap below ``NEAR_TIE`` (the
    rounding of a prefill split elsewhere, or batched with other requests, can flip those)."""

    def __init__(self, model: Callable[[], Any]) -> None:
        self._model = model  # loaded on first use: most runs never need it
        self._served: dict[Job, str] = {}
        self._done: dict[Job, Expected] = {}
        self.near_ties = 0  # answers accepted by the near-tie rule
        self.identical = 0

    def cache_free(self, client: openai.OpenAI, job_list: list[Job], threads: int) -> list[Outcome]:
        """Record the server's cache-free answers as the reference; the outcomes (their latency
        is what a request costs without any tier's help, under that load)."""
        out = run_all(client, job_list, threads, cache=False)
        failed = [o.error for o in out if o.error is not None]
        assert not failed, f"cache-free requests failed: {failed}"
        for o in out:
            if o.job in self._served:
                self.check(o.job, o.text)
            else:
                self._served[o.job] = o.text
        return out

    def expected(self, job: Job) -> Expected:
        if job not in self._done:
            model = self._model()
            engine = chat_engine(model)
            ids, dropped = engine.prompts.encode_chat(job.body())
            assert dropped == 0
            runner = model.runner
            cache = runner.new_cache(len(ids) + job.max_tokens, dtype=torch.float16)
            with torch.inference_mode():
                logits = runner.forward(ids, cache)
                tokens, gaps = [], []
                for _ in range(job.max_tokens):
                    top = torch.topk(logits.float(), 2).values
                    gaps.append(float(top[0] - top[1]))
                    tokens.append(int(logits.argmax()))
                    logits = runner.forward([tokens[-1]], cache)
            self._done[job] = Expected(ids, tokens, gaps, model.tokenizer.decode(tokens))
        return self._done[job]

    def check(self, job: Job, text: str) -> None:
        """``text`` is the reference answer, or first differs from a full prefill at a near-tie;
        otherwise an AssertionError naming the step and the gap."""
        assert job in self._served, f"no cache-free answer recorded for {job.name}"
        if text == self._served[job]:
            self.identical += 1
            return
        self.check_full_prefill(job, text)
        self.near_ties += 1

    def check_full_prefill(self, job: Job, text: str) -> None:
        exp = self.expected(job)
        if text == exp.text:
            return
        decode = self._model().tokenizer.decode
        step = next(
            (k for k in range(len(exp.tokens)) if not text.startswith(decode(exp.tokens[: k + 1]))),
            len(exp.tokens),
        )
        assert step < len(exp.tokens) and exp.gaps[step] < NEAR_TIE, (
            f"wrong answer for {job.name}: {text!r}, a full prefill says {exp.text!r}; first difference at step "
            f"{step}, where its top-2 logit gap is {exp.gaps[step] if step < len(exp.gaps) else None}"
        )


_ENGINES: dict[int, Any] = {}


def chat_engine(model):
    """A cache-free engine on ``model``, for its chat template and namespace only (one per model)."""
    from kvfuse.engine import Engine

    if id(model) not in _ENGINES:
        _ENGINES[id(model)] = (model, Engine(model, None))
    return _ENGINES[id(model)][1]


# ------------------------------------------------------------------------------------ load
@dataclass
class Outcome:
    job: Job
    text: str | None
    latency_s: float
    started: float  # time.monotonic() at the start
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    # the exception, for a request that failed (any status, any transport error)
    error: str | None = None


def client_of(srv: ServerProcess, timeout: float = 300.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=timeout)


def ask(client: openai.OpenAI, job: Job, **extra) -> Outcome:
    t0 = time.monotonic()
    try:
        r = client.chat.completions.create(
            model=MODEL,
            messages=job.body(),
            max_tokens=job.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
    except Exception as e:  # noqa: BLE001  (every failure is an outcome the test asserts on)
        return Outcome(job, None, time.monotonic() - t0, t0, error=f"{type(e).__name__}: {e}")
    details = r.usage.prompt_tokens_details
    extra_fields = details.model_extra or {}
    return Outcome(
        job,
        r.choices[0].message.content,
        time.monotonic() - t0,
        t0,
        details.cached_tokens,
        dict(extra_fields.get("cached_entries_by_tier") or {}),
    )


class Load:
    """``threads`` clients sending ``jobs`` round-robin (each thread starts at another job) until
    ``stop()``; ``wait_done(n)`` waits until ``n`` requests have finished, so a fault can be
    injected in the middle of the run."""

    def __init__(self, client: openai.OpenAI, jobs: list[Job], threads: int = 4, **extra) -> None:
        self.client, self.jobs, self.extra = client, jobs, extra
        self.outcomes: list[Outcome] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._next = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            for i in range(threads)
        ]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                job = self.jobs[self._next % len(self.jobs)]
                self._next += 1
            out = ask(self.client, job, **self.extra)
            with self._cond:
                self.outcomes.append(out)
                self._cond.notify_all()

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def done(self) -> int:
        with self._cond:
            return len(self.outcomes)

    def wait_done(self, n: int, timeout: float = 300.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.outcomes) >= n, timeout):
                raise AssertionError(
                    f"only {len(self.outcomes)} of {n} requests finished within {timeout:.0f} s"
                )

    def wait_new(self, n: int, timeout: float = 300.0) -> None:
        """Wait until ``n`` requests that started from now on have finished (so a fault injected
        just before is met by requests from their start)."""
        t0 = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(
                lambda: sum(o.started >= t0 for o in self.outcomes) >= n, timeout
            ):
                raise AssertionError(f"not {n} new requests finished within {timeout:.0f} s")

    def stop(self, timeout: float = 300.0) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
            assert not t.is_alive(), "a client thread is still waiting for its answer"
        return list(self.outcomes)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def run_all(client: openai.OpenAI, jobs: list[Job], threads: int = 4, **extra) -> list[Outcome]:
    """Every job once, ``threads`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda j: ask(client, j, **extra), jobs))


def check_outcomes(ref: Reference, outcomes: list[Outcome]) -> None:
    """No request failed, and every answer is the reference's (or differs first at a near-tie)."""
    failed = [o for o in outcomes if o.error is not None]
    assert not failed, (
        f"{len(failed)} of {len(outcomes)} requests failed, e.g. {failed[0].job.name}: {failed[0].error}"
    )
    for o in outcomes:
        ref.check(o.job, o.text)


def warm_up(
    srv: ServerProcess,
    client: openai.OpenAI,
    ref: Reference,
    job_list: list[Job],
    threads: int,
    tier_name: str,
    check_hits: bool = True,
) -> float:
    """Record the cache-free answers, store every job's chunks, and (``check_hits``) check that
    the next round reads them from ``tier_name``; the slowest cache-free request (what a request
    costs with no tier's help, under this load on this machine)."""
    free = ref.cache_free(client, job_list, threads)
    check_outcomes(ref, run_all(client, job_list, threads))
    idle(srv)
    if check_hits:
        warm = run_all(client, job_list, threads)
        check_outcomes(ref, warm)
        assert sum(o.by_tier.get(tier_name, 0) for o in warm) >= len(job_list), (
            f"the {tier_name} tier is not used"
        )
        idle(srv)
    return max(o.latency_s for o in free)


def hits_again(
    srv: ServerProcess,
    client: openai.OpenAI,
    ref: Reference,
    job_list: list[Job],
    tier_name: str,
    passes: int = 5,
) -> int:
    """Send the jobs one by one until one reuses an entry read from ``tier_name``; how many requests
    that took (AssertionError after ``passes`` passes). Each request stores what it computed."""
    sent = 0
    for _ in range(passes):
        for job in job_list:
            out = run_all(client, [job], 1)
            check_outcomes(ref, out)
            sent += 1
            if out[0].by_tier.get(tier_name):
                return sent
        idle(srv)
    raise AssertionError(
        f"no {tier_name} hit in {sent} requests after the fault: {tier(srv, tier_name)}"
    )


# ------------------------------------------------------------------------------ server state
def kv_stats(srv: ServerProcess) -> dict:
    r = httpx.get(srv.base_url + "/kv/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def tier(srv: ServerProcess, name: str) -> dict:
    return kv_stats(srv)["tiers"][name]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metrics(srv: ServerProcess) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (``_total`` kept as Prometheus writes it)."""
    r = httpx.get(srv.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """Poll ``predicate`` (a server's counters: there is no event to wait on across processes)
    until it returns something true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def idle(srv: ServerProcess, timeout: float = 120.0) -> dict:
    """Wait until the server runs nothing and every save and lower-tier write is done; its stats."""

    def quiet():
        s = kv_stats(srv)
        busy = (
            s["queue"]["waiting"]
            or s["queue"]["running"]
            or s["engine"].get("saver", {}).get("pending", 0)
            or s["tiers"].get("store", {}).get("queue_depth", 0)
        )
        return None if busy else s

    return wait_until(quiet, timeout, "the server to finish its requests, saves and writes")


# ------------------------------------------------------------------------------------ proxy
class TcpProxy:
    """A TCP proxy on 127.0.0.1 (asyncio, on a thread of its own) in front of ``upstream_port``.

    ``latency_s``: each chunk of bytes, either way, is forwarded that long after it arrived (a
    one-way delay; order kept). ``bandwidth``: bytes per second from the upstream to the client
    (None: unlimited), a slow link. ``cut_after``: a connection is reset once it has carried that
    many more bytes to the client (None: never), i.e. in the middle of a reply. ``refuse``: new
    connections are accepted and closed at once. ``drop()`` resets every open connection."""

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self.latency_s = 0.0
        self.bandwidth: float | None = None
        self.cut_after: int | None = None
        self.refuse = False
        self.connections = 0  # accepted so far
        self.dropped = 0  # connections reset by drop()
        self.cuts = 0  # connections reset mid-reply (cut_after)
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tcp-proxy", daemon=True
        )
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> TcpProxy:
        self._thread.start()

        async def listen():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        self._call(listen())
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, False),
                self._pipe(up_reader, writer, True),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            pass  # stop()
        finally:
            for w in (writer, up_writer):
                self._open.discard(w)
                w.transport.abort()

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool
    ) -> None:
        chunks: asyncio.Queue = asyncio.Queue()

        async def send():
            while (item := await chunks.get()) is not None:
                arrived, data = item
                delay = arrived + self.latency_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if downstream and self.bandwidth:
                    # a slow link: small pieces every 20 ms, not one late burst (so no single read
                    # waits as long as a socket time-out: only a bound on the whole reply notices)
                    piece = max(1, int(self.bandwidth * 0.02))
                    for i in range(0, len(data), piece):
                        await asyncio.sleep(min(piece, len(data) - i) / self.bandwidth)
                        dst.write(data[i : i + piece])
                        await dst.drain()
                else:
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        sender = asyncio.ensure_future(send())
        carried = 0
        try:
            while data := await src.read(65536):
                if downstream and self.cut_after is not None:
                    carried += len(data)
                    if carried > self.cut_after:
                        self.cuts += 1
                        dst.transport.abort()  # the client sees a reset in the middle of the reply
                        raise ConnectionResetError("cut by the proxy")
                chunks.put_nowait((time.monotonic(), data))
        finally:
            chunks.put_nowait(None)
            with contextlib.suppress(BaseException):
                await sender

    def drop(self) -> int:
        """Reset every open connection now; how many."""

        async def reset():
            n = len(self._open)
            for w in list(self._open):
                w.transport.abort()
            self._open.clear()
            return n

        n = self._call(reset())
        self.dropped += n // 2
        return n // 2

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close():
            if self._server is not None:
                self._server.close()
            for w in list(self._open):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------ disk faults
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted on ``path`` (root only), always unmounted afterwards; skips the
    test with the reason when it cannot be mounted."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a small, really full disk) needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {path}: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        u = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if u.returncode != 0:  # still in use: detach it now, it goes when the last file closes
            subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, size: str) -> None:
    """Resize the tmpfs on ``path`` (the disk is no longer full)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def entry_files(root: Path) -> list[Path]:
    """The disk tier's entry files (``<root>/<xx>/*.kvf``), oldest first."""
    files = [p for p in root.glob("[0-9a-f][0-9a-f]/*.kvf")]
    return sorted(files, key=lambda p: p.stat().st_mtime_ns)


def temp_files(root: Path) -> list[Path]:
    """Temporary files anywhere under the tier's folder (entries' and history records')."""
    return [p for p in root.rglob("*.tmp")]


def used_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def can_drop_dac() -> str | None:
    """None if a child can run as root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (so file
    permissions apply to it); else why not."""
    if os.geteuid() != 0:
        return (
            "not root: the server would run as this user, whose files chmod cannot lock it out of"
        )
    probe = subprocess.run(["setpriv", *NO_DAC, "true"], capture_output=True, text=True)
    return (
        None
        if probe.returncode == 0
        else f"setpriv cannot drop capabilities: {probe.stderr.strip()}"
    )


# Root keeps its uid (so every file the test made stays its own) but loses the two capabilities
# that bypass file permissions: a chmod 000 file or folder is then really unreadable to it.
NO_DAC = [
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
]


class PrefixedServer(ServerProcess):
    """``ServerProcess`` run under a command prefix (``setpriv ...``)."""

    def __init__(self, *args, prefix: list[str], **kw) -> None:
        super().__init__(*args, **kw)
        self.prefix = list(prefix)

    def start(self, timeout: float = 180.0) -> ServerProcess:
        import yaml

        config_path = Path(self._tmp.name) / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config))
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "kvfuse.cli",
            "serve",
            "--port",
            str(self.port),
            "--home",
            str(self.home),
            "--config",
            str(config_path),
            *self.args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})}
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvfuse serve exited with status {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(
            f"kvfuse serve did not answer /health within {timeout:.0f} s:\n{self.log_tail()}"
        )


# ---------------------------------------------------------------------------------- figures
def record(test: str, **figures) -> None:
    """A one-line summary of a fault test (faults injected, requests, wrong answers, errors
    counted), printed and, with ``KVFUSE_FAULT_REPORT`` set, appended there as JSON."""
    line = json.dumps({"test": test, **figures}, sort_keys=True)
    print("FAULTS", line)
    path = os.environ.get("KVFUSE_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def chain_paths(
    model, job: Job, chunk_size: int, root: Path, salt: str = "", tenant: str = ""
) -> list[Path]:
    """Where the disk tier under ``root`` keeps ``job``'s prefix chunks, first chunk first (the
    server's namespace: same model, KV dtype and layout; the request's ``cache_salt``). The first
    chunk of a chain is the one every later request of that prompt reads first."""
    from types import SimpleNamespace

    from kvfuse.kv.keys import prefix_keys
    from kvfuse.tiers.disk import DiskTier

    engine = chat_engine(model)
    ids, _ = engine.prompts.encode_chat(job.body())
    keys = prefix_keys(ids, chunk_size, engine.namespace(tenant, salt))
    # the tier's own layout rule
    return [Path(DiskTier._path(SimpleNamespace(root=root), k)) for k in keys]


def entry_ok(path: Path) -> bool | None:
    """None if the file is gone; whether it is an intact entry (the store's one check)."""
    from kvfuse.kv.format import FormatError, open_entry

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        open_entry(bytearray(data))
        return True
    except FormatError:
        return False
