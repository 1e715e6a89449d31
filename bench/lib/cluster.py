"""The pure parts of bench/cluster.py: its workloads (multi-user chat from ShareGPT, RAG over shared
MuSiQue documents), the summary of a pass (cache-hit share, TTFT percentiles, throughput), the
kill run's summary and the targets of issue 40, kept apart from the processes so that they are
table-tested (tests/unit/test_bench_cluster.py)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from .client import percentile, rounded
from .data import musique
from .paths import DATA

# vllm-router's flags for losing no request when a worker dies (scripts/cluster.sh starts it with
# the same; docs/deploy.md "When a server dies"). vllm-router 0.1.17 does retry a failed request
# (a connection error is its 500, which it retries, --retry-max-retries 5 by default), but each
# attempt asks the policy again, and consistent_hash / cache_aware / kv_aware pick the same dead
# worker until it leaves the rotation: by default after 10 failures (circuit breaker) or 3 failed
# health checks 60 s apart. With a threshold of 1 the first failed attempt opens the worker's
# circuit and the retry goes to another; health checks every second keep it out after
# --cb-timeout-duration-secs.
ROUTER_FAILOVER = (
    "--cb-failure-threshold", "1",
    "--cb-timeout-duration-secs", "5",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-check-timeout-secs", "2",
    "--retry-max-retries", "5",
)  # fmt: skip


# Policy variants the bench runs beside the plain policies: a name ``POLICY+VARIANT`` runs POLICY
# with these flags. ``kv_aware+affinity``: kv_aware with its session affinity (a session, by the
# X-Session-ID header, stays on its worker while it is active; new sessions, and sessions idle
# past the TTL, are routed on the KV events' prefix scores).
VARIANTS = {"": (), "affinity": ("--kv-aware-session-affinity-ttl-secs", "300")}


def router_command(
    router: str, port: int, policy: str, workers: list[str], events: list[str], block: int,
    model: str,
) -> list[str]:  # fmt: skip
    """vllm-router's command line for ``policy`` (or a ``POLICY+VARIANT`` of ``VARIANTS``) in
    front of ``workers`` (``events``: each one's KV event endpoint, read by ``kv_aware`` with the
    servers' block size and model)."""
    policy, _, variant = policy.partition("+")
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *workers, *ROUTER_FAILOVER, *VARIANTS[variant]]  # fmt: skip
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(block), "--kv-event-model", model]
        for w, e in zip(workers, events, strict=True):
            cmd += ["--kv-event-source", f"{w}={e}"]
    return cmd


@dataclass
class User:
    """One simulated end user: its turns, sent one after the other. ``history``: a chat, where each
    turn carries the earlier turns and the answers the server gave; otherwise every turn is a
    fresh question after the same system message (RAG over shared documents)."""

    uid: str
    system: str
    turns: list[str]
    history: bool


def chat_users(
    n_users: int, turns: int, chars: int, split: str = "dev", system: str = ""
) -> list[User]:
    """The first ``n_users`` ShareGPT conversations with ``turns`` user messages or more, each
    message cut to ``chars`` characters (the recorded answers are not used: the server answers),
    each after the same ``system`` message (none: the model's default)."""
    if split != "dev":
        raise ValueError(
            "the ShareGPT file here is the dev split only; the chat workload has no test"
        )
    users: list[User] = []
    with open(DATA / "sharegpt_multiturn_dev.jsonl") as f:
        for line in f:
            conv = json.loads(line)
            asks = [m["content"][:chars] for m in conv["messages"] if m["role"] == "user"]
            if len(asks) >= turns and all(a.strip() for a in asks[:turns]):
                users.append(User(f"chat-{len(users)}", system, asks[:turns], True))
            if len(users) == n_users:
                return users
    raise ValueError(f"fewer than {n_users} conversations with {turns} user turns")


def chat_system(chars: int, split: str = "dev") -> str:
    """A deployment's system message of ``chars`` characters, the same for every chat user: an
    assistant's instructions, then reference notes (MuSiQue passages of the split, in order), as
    a product's assistant carries its guidelines and knowledge in every conversation."""
    head = (
        "You are the assistant of a public reference library. Answer the visitor's messages "
        "helpfully and briefly; where the notes below help, use them.\n\nReference notes:\n\n"
    )
    text = head
    for ex in musique(split):
        for c in ex["ctxs"]:
            if len(text) >= chars:
                return text[:chars]
            text += c["text"] + "\n\n"
    return text[:chars]


def rag_system(example: dict, docs: int, chars: int) -> str:
    """A system message holding the first ``docs`` passages of a MuSiQue example (the shared
    documents: the same text, byte for byte, for every user who asks about them)."""
    passages = [c["text"][:chars] for c in example["ctxs"][:docs]]
    return "Answer from these documents.\n\n" + "\n\n".join(passages)


def rag_users(
    n_users: int, turns: int, doc_sets: int, docs: int, chars: int, split: str = "dev"
) -> list[User]:
    """Users asking about ``doc_sets`` shared document sets: user u's turn t is about set
    (u + t) mod doc_sets, with that set's question, signed by the user (so no two prompts are
    equal, only their documents are shared)."""
    examples = musique(split)[:doc_sets]
    users = []
    for u in range(n_users):
        sets = [examples[(u + t) % len(examples)] for t in range(turns)]
        # one system message per user would pin the user to one set; each turn carries its own
        users.append(
            User(
                f"rag-{u}",
                "",
                [
                    rag_system(ex, docs, chars) + f"\n\nQuestion (user {u}): " + ex["question"]
                    for ex in sets
                ],  # fmt: skip
                False,
            )
        )
    return users


def summarize_pass(samples: list[dict], wall_s: float) -> dict:
    """A pass's figures: requests, failed, cache-hit share (sum of usage ``cached_tokens`` over
    sum of ``prompt_tokens``, of the answered requests), TTFT p50 / p95 (ms), TTFT p95 of the
    turns after each user's first, requests and output tokens per second over the pass's wall
    time."""
    ok = [s for s in samples if s["ok"]]
    prompt = sum(s["prompt_tokens"] for s in ok)
    ttft = [s["ttft_s"] * 1000 for s in ok if s["ttft_s"] is not None]
    later = [s["ttft_s"] * 1000 for s in ok if s["ttft_s"] is not None and s.get("turn", 0) > 0]
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "hit_share": rounded(sum(s["cached_tokens"] for s in ok) / prompt, 4) if prompt else None,
        "ttft_p50_ms": rounded(percentile(ttft, 0.5)),
        "ttft_p95_ms": rounded(percentile(ttft, 0.95)),
        # the turns a policy can serve from cache: a user's first is cold wherever it goes
        "ttft_p95_later_ms": rounded(percentile(later, 0.95)) if later else None,
        "req_s": rounded(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "out_tok_s": rounded(sum(s["completion_tokens"] for s in ok) / wall_s, 2)
        if wall_s > 0
        else None,
    }


def request_rows(samples: list[dict]) -> list[list]:
    """Each request of a pass as ``[key, prompt_tokens, cached_tokens, TTFT ms]``, in key order:
    where a policy lost reuse (a user's turn sent to a server without its history)."""
    rows = [
        [s["key"], s["prompt_tokens"], s["cached_tokens"], rounded((s["ttft_s"] or 0) * 1000)]
        for s in samples
    ]
    return sorted(rows, key=lambda r: _user_turn(r[0]))


def median_of(passes: list[dict]) -> dict:
    """The median of every figure over the rounds' passes of one candidate (None where missing)."""
    keys = [k for k in passes[0] if not isinstance(passes[0][k], (list, dict, str))]
    out = {}
    for k in keys:
        xs = [p[k] for p in passes if p.get(k) is not None]
        out[k] = statistics.median(xs) if xs else None
    return out


def round_ratios(passes: dict[str, list[dict]], key: str, base: str = "round_robin") -> dict:
    """Per policy, ``base``'s ``key`` over the policy's in each round (pass i of every policy ran
    in round i), rounded: how a ratio of medians holds up round by round."""
    out = {}
    for policy, ps in passes.items():
        if policy == base or base not in passes:
            continue
        pairs = zip(passes[base], ps)
        out[policy] = [rounded(b[key] / x[key], 2) if b.get(key) and x.get(key) else None
                       for b, x in pairs]  # fmt: skip
    return out


def bounds(passes: list[dict], key: str) -> tuple[float, float] | None:
    """The smallest and largest ``key`` over one candidate's passes (None where none has it)."""
    xs = [p[key] for p in passes if p.get(key) is not None]
    return (min(xs), max(xs)) if xs else None


def differing(texts: dict[str, str], reference: dict[str, str]) -> tuple[list[str], list[str]]:
    """The keys (``user/turn``) of ``texts`` whose answer differs from ``reference``'s, and those
    not comparable: a later turn of a user whose earlier turn already differed was asked a
    different prompt (the history carries the answers), so its answer says nothing more."""
    diff: list[str] = []
    skipped: list[str] = []
    first: dict[str, int] = {}
    for key in sorted((k for k in texts if k in reference), key=_user_turn):
        user, turn = _user_turn(key)
        if user in first and turn > first[user]:
            skipped.append(key)
        elif texts[key] != reference[key]:
            diff.append(key)
            first[user] = turn
    return diff, skipped


def _user_turn(key: str) -> tuple[str, int]:
    user, turn = key.rsplit("/", 1)
    return user, int(turn)


def kill_summary(
    samples: list[dict], kill_at: float, reference: dict[str, str], floor: int | None = None
) -> dict:
    """The kill run: failed requests (all, and those sent after the kill); answers that differ
    from the same request's in ``reference`` (a run of the same policy without the kill), split
    by when they were answered: before the kill (the kill cannot have touched them: batched greedy
    decoding rounds differently from run to run, which ``floor``, the answers differing between
    two runs without a kill, measures) or after it (``wrong_answers``: what the kill could have
    changed); and per user whether the first answered turn sent after the kill that carries
    history reused it (``cached_tokens`` > 0; a user with none answered did not): every user
    must, the killed server's users through the shared tier (failures are counted apart)."""
    after = [s for s in samples if s["t_sent"] >= kill_at]
    first: dict[str, dict] = {}
    for s in sorted(after, key=lambda s: (not s["ok"], s["t_sent"])):  # answered ones first
        if s["turn"] > 0:
            first.setdefault(s["user"], s)
    answered = {s["key"]: s for s in samples if s["ok"]}
    diff, skipped = differing({k: s["text"] for k, s in answered.items()}, reference)
    late = [k for k in diff if answered[k].get("t_done", answered[k]["t_sent"]) >= kill_at]
    reused = {u: bool(s["ok"] and s["cached_tokens"] > 0) for u, s in first.items()}
    return {
        "failed": sum(not s["ok"] for s in samples),
        "failed_after_kill": sum(not s["ok"] for s in after),
        "compared": sum(1 for k in answered if k in reference) - len(skipped),
        "not_comparable": len(skipped),
        "wrong_answers": len(late),
        "wrong_keys": late,
        "differing_before_kill": len(diff) - len(late),
        "differing_without_kill": floor,
        "users_after_kill": len(reused),
        "users_reusing_after_kill": sum(reused.values()),
        "reused_by_user": reused,
    }


def check_targets(medians: dict[str, dict[str, dict]], kill: dict | None) -> list[dict]:
    """Issue 40's targets, each ``{target, measured, pass}`` (``pass`` None where a figure is
    missing): on chat, for kv_aware (and each of its variants run), a hit share >= cache_aware's
    and a TTFT p95 at most half of round_robin's; the kill run with 0 failed, 0 wrong answers,
    every user reusing history."""
    chat = medians.get("chat", {})
    ca, rr = chat.get("cache_aware"), chat.get("round_robin")
    out = []

    def add(name: str, measured, ok) -> None:
        out.append({"target": name, "measured": measured, "pass": ok})

    for name in ["kv_aware"] + [p for p in chat if p.startswith("kv_aware+")]:
        kv = chat.get(name)
        if kv and ca and kv["hit_share"] is not None and ca["hit_share"] is not None:
            add(f"chat: {name} hit share >= cache_aware", [kv["hit_share"], ca["hit_share"]],
                kv["hit_share"] >= ca["hit_share"])  # fmt: skip
        else:
            add(f"chat: {name} hit share >= cache_aware", None, None)
        if kv and rr and kv["ttft_p95_ms"] and rr["ttft_p95_ms"]:
            ratio = round(rr["ttft_p95_ms"] / kv["ttft_p95_ms"], 2)
            add(f"chat: TTFT p95 round_robin / {name} >= 2", ratio, ratio >= 2.0)
        else:
            add(f"chat: TTFT p95 round_robin / {name} >= 2", None, None)
    if kill is not None:
        add("kill: 0 failed requests", kill["failed"], kill["failed"] == 0)
        add("kill: 0 wrong answers", kill["wrong_answers"], kill["wrong_answers"] == 0)
        users = [kill["users_reusing_after_kill"], kill["users_after_kill"]]
        add("kill: every user reuses history after the kill", users,
            users[1] > 0 and users[0] == users[1])  # fmt: skip
    return out
