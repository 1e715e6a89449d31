"""Soak: a real server under a memory budget that forces eviction, concurrent ``openai`` clients
mixing plain prompts, RAG documents, multi-turn conversations (the whole history re-sent) and
Responses API chains, for a bounded time; then every answer is checked.

Budgets (``CONFIG``): 64-token chunks (about 1.5 MB of fp16 KV each), a 12 MiB memory tier, a
24 MiB disk tier and 24 MiB of live KV for at most 4 running sequences (one may preempt another),
against a working set of several times that: both tiers evict all the time. The default run's
20 s soak halves the two tier budgets (6 and 12 MiB) so that both still evict many times
within it.

Asserted:

- no request fails (no 5xx, nor anything else), and every kind was served;
- the server's RSS (``VmRSS``, sampled every 0.25 s) stays under ``RSS after start-up and one
  request (the model and the runtime) + cache.memory_bytes + engine.kv_memory_bytes +
  RSS_MARGIN``; the margin (256 MiB) covers what is allocated beside the two budgets: the store's
  write queue (up to 64 entries of 1.5 MB in flight to the disk tier), entries read from disk
  before promotion, the saver's copies, activations and allocator slack;
- the disk tier never holds more than ``cache.disk_bytes``, nor the memory tier more than
  ``cache.memory_bytes`` (``/v1/kv/stats``, sampled every 2 s), and both evicted (else the budgets
  forced nothing);
- every greedy answer equals its reference, or differs first where the reference's top-2 logit
  gap was below 1e-3 (the near-tie rule, ``load.py``). Plain and conversation requests (and
  Responses turns, which are conversations) are compared with a cache-free full prefill of the
  same token ids (``load.greedy_reference``). RAG requests run with the default
  ``recompute_ratio`` (0.15): a blend is then legitimately not a full prefill, so they are
  compared with *the same request served by a cache-empty engine with the server's settings*
  (gaps from ``Engine.score`` on the same path). Such an engine has two right answers: the
  blend's, and, once a blend of those documents stored its KV as prefix chunks, the prefix
  hit's (the chunks loaded, the rest computed in full: other numbers at a ratio below 1); an
  answer must match one of them. Ratio 1.0 against a full prefill was not chosen: it recomputes
  every document token, so the cached document KV would be nearly unused and a wrong one would
  go unnoticed. What must hold is that documents and blended prefixes served from the cache
  (evicted, re-read from disk, moved to their positions) change nothing but float rounding.

The default run soaks for ``FAST_SOAK_S`` seconds; ``-m slow`` for ``$KVFUSE_SOAK_S`` (600).
Requests served, near-ties and mismatches are printed (``-s``) for docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch
from kvfuse_helpers import SENTENCES, load_builtin
from load import NEAR_TIE, Tally, greedy_reference, rss_bytes
from openai import OpenAI

from kvfuse.config import load_config
from kvfuse.generation import SamplingParams
from kvfuse.runtime import open_engine
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
MiB = 1 << 20
CH = 64
MEMORY_BYTES, DISK_BYTES, KV_BYTES = 12 * MiB, 24 * MiB, 24 * MiB
RSS_MARGIN = 256 * MiB
MAX_TOKENS = 8
CLIENTS = 4
FAST_SOAK_S = 20.0  # 15 s served fewer than 4 * CLIENTS answers on a loaded 2-core machine
# the fast soak's tier budgets: with the long soak's, a short soak fills the disk tier barely
FAST_TIERS = (6 * MiB, 12 * MiB)  # memory, disk
CONFIG = {
    "model": MODEL,
    "cache": {"chunk_size": CH, "memory_bytes": MEMORY_BYTES, "disk_bytes": DISK_BYTES},
    "engine": {"max_running": 4, "kv_memory_bytes": KV_BYTES},
    "server": {"max_queue": 256},
}


# ------------------------------------------------------------------------------ the workload


def words(seed: int, n: int) -> str:
    rnd = random.Random(seed)
    pool = [w.strip(".,") for s in SENTENCES for w in s.split()]
    return " ".join(rnd.choice(pool) for _ in range(n))


class Workload:
    """The distinct requests the clients draw from (``scale``: how many of each; the default run's
    references must be computed in seconds, the slow run's working set is larger)."""

    def __init__(self, scale: int):
        self.plain = [
            f"Report {i}. {words(10 + i, 60 + 45 * i)}.\n\nIn one sentence, the report says"
            for i in range(2 * scale + 1)
        ]
        self.rag = [
            ([f"Record {d}. {words(100 + 7 * d + j, 60 + 25 * j)}." for j in range(2)], q)
            for d in range(scale)
            for q in ("What is recorded first?", "Name one place mentioned.")
        ]
        topics = ("harbours", "bread", "ferries")
        self.conversations = [
            (
                "You are a terse assistant. " + words(200 + c, 40),
                [f"Tell me about {t}. {words(300 + 10 * c + k, 30)}" for k, t in enumerate(topics)],
            )
            for c in range(scale)
        ]
        self.chains = [
            (
                "Answer briefly.",
                [f"{words(400 + 10 * c, 90)}\n\nWhat is this about?", "And what next?"],
            )
            for c in range(scale)
        ]


def conversation(system: str, users: list[str], answers: list[str]) -> list[dict]:
    """The messages of the turn after ``answers`` (the whole history re-sent)."""
    out = [{"role": "system", "content": system}]
    for k, answer in enumerate(answers):
        out += [{"role": "user", "content": users[k]}, {"role": "assistant", "content": answer}]
    return out + [{"role": "user", "content": users[len(answers)]}]


def key_of(kind: str, payload) -> str:
    return kind + ":" + json.dumps(payload, sort_keys=True)


# ------------------------------------------------------------------------------ references


class ServerReferences:
    """The cache-free answer of every distinct request, asked from the server itself while the
    soak runs (one more request per distinct request, part of the load): ``cache: false`` for
    plain, conversation and Responses requests (a Responses turn as the chat request it is), and
    for RAG (which needs the cache) the same request in a namespace no one used before (a fresh
    ``cache_salt``: cache-empty), twice, for the blend's answer and the prefix hit's (see
    ``References._compute``). An answer equal to one of them is right; any other is judged by
    ``References`` (in-process, with the near-tie rule)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.answers: dict[str, list[str] | None] = {}  # None: being asked

    def ensure(self, kind: str, payload, c: OpenAI, tally: Tally) -> None:
        key = key_of(kind, payload)
        with self.lock:
            if key in self.answers:
                return
            self.answers[key] = None
        try:
            got = self._ask(kind, payload, c)
            tally.served("reference", 0)
        except Exception:
            with self.lock:
                del self.answers[key]  # asked again later
            raise
        with self.lock:
            self.answers[key] = got

    @staticmethod
    def _ask(kind: str, payload, c: OpenAI) -> list[str]:
        if kind == "plain":
            r = c.completions.create(
                model=MODEL,
                prompt=payload,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "cache": False},
            )
            return [r.choices[0].text]
        if kind in ("conv", "resp"):  # a Responses turn stops at EOS: no ignore_eos
            r = c.chat.completions.create(
                model=MODEL,
                messages=payload,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": kind == "conv", "cache": False},
            )
            return [r.choices[0].message.content]
        docs, question = payload
        salt, out = f"reference-{uuid.uuid4().hex}", []
        for _ in range(2):
            r = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"documents": docs, "ignore_eos": True, "cache_salt": salt},
            )
            out.append(r.choices[0].message.content)
        return out


class References:
    """In-process greedy references by request key, for answers that differ from the server's
    cache-free one: one or more (tokens, top-2 gaps, whether the answer stops at EOS); an answer
    may match any of them (RAG has two, see ``_compute``)."""

    def __init__(self, home):
        self.model = load_builtin(MODEL)
        base = {"home": str(home), "model": MODEL, "cache.chunk_size": CH}
        self.encoder = open_engine(
            load_config(overrides={**base, "cache.enabled": False}), model=self.model
        )
        self.blender = open_engine(
            load_config(overrides={**base, "cache.disk": False}),
            model=self.model,
            store=TieredStore(MemoryTier(1 << 30)),
        )
        self.tokenizer = self.model.tokenizer
        self.eos = set(self.model.eos_token_ids)
        self.refs: dict[str, list[tuple[list[int], list[float], bool]]] = {}

    def of(self, kind: str, payload) -> list[tuple[list[int], list[float], bool]]:
        key = key_of(kind, payload)
        if key not in self.refs:
            self.refs[key] = self._compute(kind, payload)
        return self.refs[key]

    def _compute(self, kind: str, payload):
        if kind == "plain":
            return [
                (
                    *greedy_reference(
                        self.model, self.encoder.prompts.encode_prompt(payload), MAX_TOKENS
                    ),
                    False,
                )
            ]
        if kind in ("conv", "resp"):
            ids, dropped = self.encoder.prompts.encode_chat(payload)
            assert dropped == 0
            # responses stop at EOS
            return [(*greedy_reference(self.model, ids, MAX_TOKENS), kind == "resp")]
        # RAG, served by a cache-empty engine with the server's settings. Two answers are right:
        # the blend's (the documents computed or loaded, then blended), and, once a blend of the
        # same documents stored its KV as prefix chunks, the prefix hit's (those chunks loaded,
        # the rest of the prompt computed in full): not the same numbers at a ratio below 1.
        docs, question = payload
        prompt = self.blender.prompts.document_prompt(
            docs, messages=[{"role": "user", "content": question}]
        )
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        out = []
        self.blender.clear_cache("")
        for path in ("blend", "prefix hit"):
            result = self.blender.generate(prompt, params)
            self.blender.flush()
            assert (result.cached_tokens >= CH) == (path == "prefix hit"), (
                path,
                result.cached_tokens,
            )
            out.append(result.token_ids)
        gaps = []
        self.blender.clear_cache("")
        for tokens in out:  # the same two paths, teacher-forced: the logits at every step
            logits = self.blender.score(prompt, [tokens])[0].float()
            top = torch.topk(logits, 2, dim=-1).values
            gaps.append((top[:, 0] - top[:, 1]).tolist())
            # the blended prefix, stored
            self.blender.generate(prompt, SamplingParams(max_tokens=1))
            self.blender.flush()
        self.blender.clear_cache("")
        return [(tokens, g, False) for tokens, g in zip(out, gaps)]

    def text(self, ref) -> str:
        tokens, _, stops = ref
        return self.tokenizer.decode(self._cut(tokens, stops))

    def _cut(self, tokens: list[int], stops: bool) -> list[int]:
        if stops:
            end = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
            return tokens[:end]
        return tokens

    def verdict(self, kind: str, payload, text: str) -> str:
        """ "same", "near_tie" or "wrong" for the server's answer ``text`` (the best over the
        request's references): the first step where it leaves a reference is where the decoded
        reference stops being a prefix of it."""
        verdicts = [self._verdict(ref, text) for ref in self.of(kind, payload)]
        return min(verdicts, key=["same", "near_tie", "wrong"].index)

    def _verdict(self, ref, text: str) -> str:
        tokens, gaps, stops = ref
        tokens = self._cut(tokens, stops)
        if text == self.tokenizer.decode(tokens):
            return "same"
        step = 0
        while step < len(tokens) and text.startswith(self.tokenizer.decode(tokens[: step + 1])):
            step += 1
        return "near_tie" if step < len(gaps) and gaps[step] < NEAR_TIE else "wrong"


# ------------------------------------------------------------------------------ clients


class Client(threading.Thread):
    """One client thread: requests of every kind in turn until the deadline."""

    def __init__(
        self,
        index: int,
        server: ServerProcess,
        workload: Workload,
        refs: ServerReferences,
        deadline: float,
        tally: Tally,
        results: list,
    ):
        super().__init__(name=f"soak-client-{index}", daemon=True)
        self.index, self.w, self.deadline, self.tally, self.results = (
            index,
            workload,
            deadline,
            tally,
            results,
        )
        self.refs = refs
        self.c = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        self.rnd = random.Random(index)
        self.conversation = (index % len(workload.conversations), [])  # (script, answers so far)
        self.chain = (
            index % len(workload.chains),
            [],
            None,
        )  # (script, answers so far, previous id)

    def run(self) -> None:
        kinds = ["plain", "rag", "conv", "resp"]
        i = self.index
        while time.monotonic() < self.deadline:
            kind = kinds[i % len(kinds)]
            i += 1
            try:
                getattr(self, kind)()
            except openai.APIStatusError as e:
                self.tally.error(f"{kind}: {e.message}", e.status_code)
                self.conversation, self.chain = (
                    (self.conversation[0], []),
                    (self.chain[0], [], None),
                )
            except Exception as e:  # a dropped connection, a time-out: a failure too
                self.tally.error(f"{kind}: {e!r}", None)
                self.conversation, self.chain = (
                    (self.conversation[0], []),
                    (self.chain[0], [], None),
                )

    def _done(self, kind: str, payload, text: str, cached: int) -> None:
        self.tally.served(kind, cached)
        with self.tally.lock:
            self.results.append((kind, payload, text))
        self.refs.ensure(kind, payload, self.c, self.tally)

    def plain(self) -> None:
        p = self.rnd.choice(self.w.plain)
        r = self.c.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        self._done("plain", p, r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens)

    def rag(self) -> None:
        docs, q = self.rnd.choice(self.w.rag)
        r = self.c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"documents": docs, "ignore_eos": True},
        )
        self._done(
            "rag",
            [docs, q],
            r.choices[0].message.content,
            r.usage.prompt_tokens_details.cached_tokens,
        )

    def conv(self) -> None:
        script, answers = self.conversation
        system, users = self.w.conversations[script]
        messages = conversation(system, users, answers)
        r = self.c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = r.choices[0].message.content
        self._done("conv", messages, text, r.usage.prompt_tokens_details.cached_tokens)
        answers = answers + [text]
        self.conversation = (
            script,
            answers if len(answers) < len(users) else [],
        )  # then start over

    def resp(self) -> None:
        script, answers, previous = self.chain
        instructions, inputs = self.w.chains[script]
        r = self.c.responses.create(
            model=MODEL,
            instructions=instructions,
            input=inputs[len(answers)],
            previous_response_id=previous,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        messages = conversation(instructions, inputs, answers)
        self._done("resp", messages, r.output_text, r.usage.input_tokens_details.cached_tokens)
        answers = answers + [r.output_text]
        self.chain = (script, answers, r.id) if len(answers) < len(inputs) else (script, [], None)


# ------------------------------------------------------------------------------ the soak


def soak(home, tmp_path, seconds: float, scale: int, tiers=(MEMORY_BYTES, DISK_BYTES)) -> None:
    """Soak for ``seconds`` with ``Workload(scale)`` and the tier budgets ``tiers`` (memory,
    disk bytes)."""
    ensure_model(home, MODEL)
    workload = Workload(scale)
    budgets = {"memory_bytes": tiers[0], "disk_bytes": tiers[1]}
    config = {
        **CONFIG,
        "cache": {**CONFIG["cache"], **budgets, "disk_path": str(tmp_path / "kv")},
        "responses": {"path": str(tmp_path / "responses.sqlite3")},
    }
    server = ServerProcess(home, config=config, log_path=tmp_path / "server.log")
    server.start()
    try:
        run_soak(server, home, workload, seconds, tiers)
    finally:
        server.close()


def run_soak(server: ServerProcess, home, workload: Workload, seconds: float, tiers) -> None:
    memory_bytes, disk_bytes = tiers
    warm = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    # runtime warm
    warm.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"cache": False})
    rss_start = rss_bytes(server.pid)
    bound = rss_start + memory_bytes + KV_BYTES + RSS_MARGIN
    tally, results = Tally(), []
    samples = {"rss": [], "disk": [], "memory": []}
    stop = threading.Event()

    def monitor() -> None:
        last_stats = 0.0
        while not stop.is_set():
            samples["rss"].append(rss_bytes(server.pid))
            if time.monotonic() - last_stats >= 2.0:
                last_stats = time.monotonic()
                tiers = httpx.get(server.base_url + "/kv/stats", timeout=60).json()["tiers"]
                samples["disk"].append(tiers["disk"]["used_bytes"])
                samples["memory"].append(tiers["memory"]["used_bytes"])
            stop.wait(0.25)

    watcher = threading.Thread(target=monitor, name="soak-monitor", daemon=True)
    watcher.start()
    deadline = time.monotonic() + seconds
    server_refs = ServerReferences()
    clients = [
        Client(i, server, workload, server_refs, deadline, tally, results) for i in range(CLIENTS)
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join(seconds + 900)
    stop.set()
    watcher.join(30)
    stats = httpx.get(server.base_url + "/kv/stats", timeout=60).json()
    tiers, engine = stats["tiers"], stats["engine"]

    judged = 0
    local: References | None = None
    for kind, payload, text in results:
        key = key_of(kind, payload)
        if server_refs.answers.get(key) is None:  # the soak ended before it was asked
            server_refs.ensure(kind, payload, warm, tally)
        if text in server_refs.answers[key]:
            tally.verdict(key, "same")
            continue
        local = local or References(home)  # the model, loaded here only when an answer differs
        judged += 1
        tally.verdict(
            f"{kind} {json.dumps(payload)[:160]} -> {text!r}", local.verdict(kind, payload, text)
        )
    peak = max(samples["rss"])
    print(
        f"served {tally.total} requests {tally.requests} in {seconds:.0f} s; same {tally.same}, near-ties "
        f"{tally.near_ties}, wrong {len(tally.wrong)}; cached tokens {tally.cached_tokens}; errors "
        f"{len(tally.status_5xx)} 5xx, {len(tally.other_errors)} other; {judged} answers judged by the "
        f"in-process reference"
    )
    print(
        f"RSS start {rss_start / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB; disk peak "
        f"{max(samples['disk'], default=0) / MiB:.1f} of {disk_bytes / MiB:.0f} MiB; evictions memory "
        f"{tiers['memory'].get('evictions')} disk {tiers['disk'].get('evictions')}; preemptions "
        f"{engine.get('preemptions')}; unusable entries {tiers['store'].get('unusable_entries')}"
    )

    assert not tally.status_5xx, tally.status_5xx[:10]
    assert not tally.other_errors, tally.other_errors[:10]
    assert set(tally.requests) == {"plain", "rag", "conv", "resp", "reference"}, tally.requests
    assert len(results) >= 4 * CLIENTS, "the soak served almost nothing"
    assert not tally.wrong, (
        "answers that differ from their reference beyond a near-tie:\n"
        + "\n".join(tally.wrong[:10])
    )
    assert peak <= bound, (
        f"RSS peaked at {peak / MiB:.0f} MiB, over the {bound / MiB:.0f} MiB bound"
    )
    assert samples["disk"] and max(samples["disk"]) <= disk_bytes
    assert max(samples["memory"]) <= memory_bytes
    assert (
        tiers["disk"]["capacity_bytes"] == disk_bytes
        and tiers["memory"]["capacity_bytes"] == memory_bytes
    )
    assert tiers["memory"]["evictions"] > 0 and tiers["disk"]["evictions"] > 0, (
        "the budgets forced no eviction"
    )
    assert tally.cached_tokens > 0


def test_soak_fast(kvfuse_home, tmp_path):
    soak(kvfuse_home, tmp_path, FAST_SOAK_S, 1, FAST_TIERS)


@pytest.mark.slow
def test_soak_long(kvfuse_home, tmp_path):
    soak(kvfuse_home, tmp_path, float(os.environ.get("KVFUSE_SOAK_S", "600")), scale=3)


def test_the_judge_tells_a_wrong_answer_from_a_right_one(kvfuse_home):
    """The in-process judge (used for any answer that differs from the server's cache-free one)
    accepts the reference and rejects an answer that leaves it where the reference was sure."""
    refs = References(kvfuse_home)
    prompt = Workload(1).plain[0]
    ((tokens, gaps, _),) = refs.of("plain", prompt)
    right = refs.tokenizer.decode(tokens)
    assert refs.verdict("plain", prompt, right) == "same"
    # a step where the reference is sure
    step = next(i for i, g in enumerate(gaps) if g >= NEAR_TIE)
    other = next(
        t
        for t in range(100, 200)
        if refs.tokenizer.decode(tokens[:step] + [t]) != refs.tokenizer.decode(tokens[: step + 1])
    )
    wrong = refs.tokenizer.decode(tokens[:step] + [other])
    assert refs.verdict("plain", prompt, wrong) == "wrong"
