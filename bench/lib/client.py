"""The client side of the serving benchmarks: every server (kvfuse, vLLM, llama.cpp) is measured by
this same code, through the official ``openai`` client, so that their numbers differ only by the
server.

A request is greedy (temperature 0) and streamed with ``stream_options={"include_usage": True}``;
its TTFT is client-side (request sent -> first chunk with content), its inter-token gaps are the
gaps between content chunks, its output tokens ``usage.completion_tokens`` of the last chunk."""

from __future__ import annotations

import datetime as _dt
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the value at index round(q (n - 1)) of the sorted values (None if empty)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def rounded(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


@dataclass
class Request:
    """One unit of work for a client: a completion prompt, a one-shot chat, or a conversation."""

    key: str  # names the request (a conversation's turns: key/turnN) to compare outputs across runs
    prompt: str | None = None
    messages: list[dict] | None = None
    conversation: list[str] | None = None  # chat: the user turns; the history is kept per client
    system: str = ""  # a conversation's system message


@dataclass
class Workload:
    name: str
    requests: list[Request]
    max_tokens: int
    source: str


@dataclass
class Pass:
    """What one pass of a workload produced: per-request samples, errors, outputs, wall time."""

    samples: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    ran_at: str = ""


def request_extra(cache: bool, salt: str, ignore_eos: bool, user: str | None = None) -> dict:
    """The request's extra body: a ``cache_salt`` per run with the cache on (every run starts cold;
    kvfuse and vLLM honour it), kvfuse's ``"cache": false`` for its cache-off runs, ``ignore_eos``,
    and OpenAI's ``prompt_cache_key`` per user where given. Fields a server does not know it
    ignores (llama-server: cache_salt and prompt_cache_key)."""
    extra: dict[str, Any] = {"cache_salt": salt} if cache else {"cache": False}
    if ignore_eos:
        extra["ignore_eos"] = True
    if user is not None:
        extra["prompt_cache_key"] = f"{salt}/{user}"
    return extra


class Runner:
    """Streams requests to one server's OpenAI API; ``run`` drives N concurrent clients."""

    def __init__(self, base_url: str, model: str, server: str, ignore_eos: bool):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=1800)
        self.model = model
        self.server = server
        self.ignore_eos = ignore_eos

    def stream(
        self, extra: dict, max_tokens: int, prompt: str | None = None, messages: list | None = None
    ) -> dict:
        """One streamed request: TTFT, latency, inter-token gaps, text, token counts."""
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
            c = chunk.choices[0]
            piece = c.delta.content if messages is not None else c.text
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
        return sample(t0, time.perf_counter(), arrivals, "".join(text), usage)

    def extra(self, cache: bool, salt: str) -> dict:
        return request_extra(cache, salt, self.ignore_eos)

    def run(self, wl: Workload, concurrency: int, extra: dict) -> Pass:
        """``concurrency`` client threads take ``wl``'s requests from one queue until it is empty;
        a conversation's turns go in order on one client, each sending the whole history."""
        work: queue.Queue[Request] = queue.Queue()
        for r in wl.requests:
            work.put(r)
        out, lock = Pass(), threading.Lock()

        def one(key: str, **kw) -> dict | None:
            try:
                s = self.stream(extra, wl.max_tokens, **kw)
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    out.errors.append(f"{key}: {type(e).__name__}: {e}"[:300])
                return None
            with lock:
                out.samples.append(s)
                out.outputs[key] = s["text"]
            return s

        def client() -> None:
            while True:
                try:
                    r = work.get_nowait()
                except queue.Empty:
                    return
                if r.conversation is None:
                    one(r.key, prompt=r.prompt, messages=r.messages)
                else:
                    converse(r, one)

        out.ran_at = utc_now()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.wall_s = time.perf_counter() - t0
        return out


def converse(r: Request, one) -> None:
    """A conversation's turns in order, each with the whole history (the server's replies too)."""
    history = [{"role": "system", "content": r.system}]
    for t, ask in enumerate(r.conversation or ()):
        history.append({"role": "user", "content": ask})
        s = one(f"{r.key}/turn{t}", messages=list(history))
        if s is None:
            break
        history.append({"role": "assistant", "content": s["text"]})


def sample(t0: float, end: float, arrivals: list[float], text: str, usage) -> dict:
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft": (arrivals[0] if arrivals else end) - t0,
        "latency": end - t0,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "text": text,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else len(arrivals),
        "cached": details.cached_tokens
        if details is not None and details.cached_tokens is not None
        else None,
    }


def concurrently(fn, items) -> float:
    """``fn(i, item)`` for every item, each in its own thread, all at once; the wall seconds."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=fn, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def warm_up(runner: Runner, clients: int) -> None:
    """A completion and a chat, then ``clients`` short chats at once (first-use costs of batch
    shapes). kvfuse's run with its cache off, the others' with their own ``cache_salt``."""
    cache = runner.server != "kvfuse"
    extra = runner.extra(cache, "warmup")
    first = [
        Request("w0", prompt="The capital of France is"),
        Request("w1", messages=[{"role": "user", "content": "Say hello."}]),
    ]
    runner.run(Workload("warmup", first, 4, ""), 1, extra)
    chats = [
        Request(f"w{i}", messages=[{"role": "user", "content": f"Count to {i + 2}."}])
        for i in range(clients)
    ]
    runner.run(Workload("warmup", chats, 4, ""), clients, extra)


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


def first_token(
    base_url: str,
    prompt: list[int] | str,
    max_tokens: int = 16,
    model: str = "smollm2",
    timeout: float = 600.0,
) -> tuple[float, str, dict[str, Any]]:
    """Send a greedy streamed completion; (seconds to the first token, the whole text, usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ttft, _last, text, usage = timed_completion(base_url, body, timeout)
    if ttft is None:
        raise RuntimeError("the completion streamed no text")
    return ttft, text, usage


def timed_completion(
    base_url: str, body: dict[str, Any], timeout: float = 600.0
) -> tuple[float | None, float | None, str, dict[str, Any]]:
    """POST ``body`` to ``/completions``, streamed with usage; (seconds from the request to the
    first and to the last piece of text, None without any, the whole text, usage)."""
    import httpx

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], {}
    url = base_url.rstrip("/") + "/completions"
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                    text.append(choice["text"])
            usage = event.get("usage") or usage
    return first, last, "".join(text), usage
