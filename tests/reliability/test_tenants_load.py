"""Tenants under load: a real server with three API keys, concurrent clients of every tenant sending
the same prompts, documents, conversations and Responses requests.

What must hold:

- no cross-tenant hits: each tenant's first request of a prompt reports 0 cached tokens, whether
  another tenant ran it before (and its entries sit in memory and on disk) or runs it at the very
  same moment (the engine's "wait for a running sequence's chunks" must not cross tenants); the
  tenant's own repeat reports cached tokens (so the counter is live);
- nothing of one tenant is visible to another: no storage key, namespace or tenant tag, no
  document or prompt text, no tenant name in what another tenant receives from ``/v1/kv/stats``,
  ``/metrics``, ``DELETE /v1/kv``, error bodies (404s for another tenant's Responses id answer
  exactly like an unknown id; 400s), or its own completions;
- ``DELETE /v1/kv`` of one tenant removes its entries only (the others still hit);
- with signing on (``cache.signing_key_file``, two keys: the first signs), as a shared deployment
  runs: every entry on disk is signed, the hits above are read through the signature check, and
  no key shows in anything a tenant receives or in the server's log.
"""

from __future__ import annotations

import itertools
import random
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from kvfuse_helpers import SENTENCES, long_text
from openai import OpenAI

from kvfuse.kv.format import read_header
from kvfuse.kv.keys import tenant_tag
from kvfuse.kv.signing import EntrySigner
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
TENANTS = {"alice": "sk-alice-4c1d", "bob": "sk-bob-88e0", "carol": "sk-carol-19ab"}
CH = 64  # small chunks: short prompts still have whole chunks to share (or not)
MAX_TOKENS = 4
KEY_RE = re.compile(r"[0-9a-f]{48}:[pdt]:[0-9a-f]{64}")
HEX64_RE = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
SIGNING_KEYS = [secrets.token_hex(32), secrets.token_hex(32)]  # the first signs (a rotation's list)


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    tmp = tmp_path_factory.mktemp("tenants-load")
    key_file = tmp / "signing.keys"
    key_file.write_text("# the first key signs\n" + "\n".join(SIGNING_KEYS) + "\n")
    key_file.chmod(0o600)
    config = {
        "model": MODEL,
        "cache": {
            "disk_path": str(tmp / "kv"),
            "chunk_size": CH,
            "signing_key_file": str(key_file),
        },
        "engine": {"max_running": 8},
        "responses": {"path": str(tmp / "responses.sqlite3")},
        "server": {
            "api_keys": [f"{key}:{tenant}" for tenant, key in TENANTS.items()],
            "max_queue": 256,
        },
    }
    srv = ServerProcess(kvfuse_home, config=config)
    srv.start()
    srv.kv_dir = tmp / "kv"
    yield srv
    srv.close()


def client(server, tenant: str) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=TENANTS[tenant], max_retries=0, timeout=600)


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[tenant]}"}


# ------------------------------------------------------------------------------ the shared workload


WORDS = sorted({w.strip(".,") for s in SENTENCES for w in s.split()})


def text(seed: int, words: int) -> str:
    """Words in a seeded random order: no run of tokens recurs between two texts, so a tenant's
    prompts share nothing with each other (only the same prompt of another tenant matches)."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words)) + "."


def shared_specs(per_kind: int, run: str) -> list[dict]:
    """The prompts every tenant sends, ``per_kind`` of every kind (each long enough for whole
    64-token chunks), in namespaces of the test run ``run``."""
    specs = []
    for i in range(per_kind):
        specs.append(
            {
                "kind": "completion",
                "prompt": text(100 + i, 120) + "\nQuestion: who built it?\nAnswer:",
            }
        )
        specs.append(
            {
                "kind": "chat",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": text(200 + i, 120)},
                ],
            }
        )
        specs.append(
            {
                "kind": "rag",
                "documents": [text(300 + i, 60), text(400 + i, 60)],
                "messages": [{"role": "user", "content": f"Question {i}: what do visitors do?"}],
            }
        )
        specs.append(
            {
                "kind": "responses",
                "instructions": "Answer in one sentence.",
                "input": text(500 + i, 120),
            }
        )
    for i, spec in enumerate(specs):
        # A namespace of its own per prompt (the same in every tenant): a tenant's prompts then share
        # nothing with each other (not even the chat template's first tokens, which a stored history
        # would lend to the next chat prompt), so its first request of each must reuse exactly 0.
        spec["salt"] = f"{run}-prompt-{i}"
    return specs


def send(c: OpenAI, spec: dict) -> tuple[int, str, str | None]:
    """One request of ``spec``: (cached tokens, text, the Responses id if any)."""
    kind = spec["kind"]
    extra = {"cache_salt": spec["salt"]} if "salt" in spec else {}
    if kind == "completion":
        r = c.completions.create(
            model=MODEL,
            prompt=spec["prompt"],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra or None,
        )
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text, None
    if kind in ("chat", "rag"):
        body = {**extra, **({"documents": spec["documents"]} if kind == "rag" else {})}
        r = c.chat.completions.create(
            model=MODEL,
            messages=spec["messages"],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=body or None,
        )
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content, None
    r = c.responses.create(
        model=MODEL,
        instructions=spec["instructions"],
        input=spec["input"],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra or None,
    )
    return r.usage.input_tokens_details.cached_tokens, r.output_text, r.id


class Seen:
    """Every body one tenant received, to scan for what belongs to the others."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bodies: dict[str, list[str]] = {t: [] for t in TENANTS}

    def add(self, tenant: str, what: str, body: str) -> None:
        with self.lock:
            self.bodies[tenant].append(f"{what}: {body}")


# ------------------------------------------------------------------------------ the test


@pytest.mark.slow  # the default run has tests/integration/test_server_tenants.py (CI time)
def test_tenants_under_concurrent_load_share_nothing(server):
    tenants_under_load(server, per_kind=1, run="fast")


@pytest.mark.slow
def test_tenants_under_heavier_concurrent_load_share_nothing(server):
    tenants_under_load(server, per_kind=4, run="slow")


def tenants_under_load(server, per_kind: int, run: str) -> None:
    clients = {t: client(server, t) for t in TENANTS}
    specs = shared_specs(per_kind, run)
    seen = Seen()
    firsts: list[tuple[str, str, int]] = []  # (tenant, spec, cached tokens of its first request)
    repeats: list[tuple[str, str, int]] = []
    response_ids: dict[str, list[str]] = {t: [] for t in TENANTS}
    lock = threading.Lock()

    def run(tenant: str, i: int, phase: str) -> None:
        cached, text, rid = send(clients[tenant], specs[i])
        seen.add(tenant, f"{phase} {i}", text)
        with lock:
            (firsts if phase == "first" else repeats).append(
                (tenant, f"{specs[i]['kind']} {i}", cached)
            )
            if rid:
                response_ids[tenant].append((rid, specs[i]["salt"]))

    # Half the prompts: every tenant sends its first request of it at the same moment. The other
    # half: one tenant first (its entries stored), then the other two together. Then every
    # tenant repeats every prompt. Scenarios run four at a time: a dozen clients in flight.
    order = list(TENANTS)
    rnd = random.Random(7)

    def scenario(i: int) -> None:
        tenants = order[i % 3 :] + order[: i % 3]
        with ThreadPoolExecutor(3) as pool:
            if i % 2 == 0:
                list(pool.map(lambda t: run(t, i, "first"), tenants))
            else:
                run(tenants[0], i, "first")
                list(pool.map(lambda t: run(t, i, "first"), tenants[1:]))
            again = tenants[:]
            rnd.shuffle(again)
            list(pool.map(lambda t: run(t, i, "repeat"), again))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(scenario, range(len(specs))))

    assert len(firsts) == 3 * len(specs) and len(repeats) == 3 * len(specs)
    crossed = [f for f in firsts if f[2] != 0]
    assert not crossed, (
        f"first requests of a tenant reported cached tokens (another tenant's KV): {crossed}"
    )
    cold = [r for r in repeats if r[2] == 0]
    assert not cold, (
        f"repeats that reused nothing (the cache is not working, the check above proves nothing): {cold}"
    )

    # A follow-up of each tenant's own stored response reuses it; another tenant's id is a 404
    # exactly like an unknown id (the id is the caller's own input; nothing else differs).
    check_responses_isolation(server, clients, response_ids, seen)
    # Every tenant also sends a private prompt and document; then nothing of it may show anywhere
    # another tenant can look.
    private = send_private(clients, seen)
    probe_everything(server, seen, private)
    check_delete_isolation(server, clients, specs, seen)
    scan(seen, private)
    check_signing(server)
    print(
        f"\ntenants: {len(TENANTS)}, {len(firsts)} first requests (0 reused anything), {len(repeats)} repeats "
        f"({sum(r[2] for r in repeats)} cached tokens), {sum(map(len, seen.bodies.values()))} bodies scanned, "
        f"0 leaks"
    )


def check_responses_isolation(server, clients, response_ids, seen) -> None:
    for tenant, c in clients.items():
        rid, salt = response_ids[tenant][0]
        follow = c.responses.create(
            model=MODEL,
            previous_response_id=rid,
            input="And then?",
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        assert follow.usage.input_tokens_details.cached_tokens > 0
        seen.add(tenant, "follow-up", follow.output_text)
    unknown = "resp_" + "0" * 32
    for owner, other in itertools.permutations(TENANTS, 2):
        rid = response_ids[owner][0][0]
        for method, path, body in (
            ("GET", "/responses/{}", None),
            ("GET", "/responses/{}/input_items", None),
            ("DELETE", "/responses/{}", None),
            (
                "POST",
                "/responses",
                {
                    "model": MODEL,
                    "input": "hi",
                    "previous_response_id": "{}",
                    "max_output_tokens": 1,
                },
            ),
        ):
            answers = []
            for target in (rid, unknown):
                json_body = (
                    None
                    if body is None
                    else {
                        k: (v.format(target) if isinstance(v, str) else v) for k, v in body.items()
                    }
                )
                r = httpx.request(
                    method,
                    server.base_url + path.format(target),
                    json=json_body,
                    headers=headers(other),
                    timeout=120,
                )
                seen.add(other, f"{method} {path} of {owner}'s id", r.text)
                answers.append((r.status_code, r.text.replace(target, "<id>")))
            assert answers[0][0] == 404, (method, path, answers[0])
            assert answers[0] == answers[1], (
                f"{other} can tell {owner}'s response exists: {answers}"
            )
        # still there for its owner (not deleted)
        assert clients[owner].responses.retrieve(rid).id == rid


def send_private(clients, seen) -> dict[str, list[str]]:
    """Each tenant's private prompt, document and Responses input, with markers no other tenant sends."""
    private = {}
    for tenant, c in clients.items():
        marker = f"zq{tenant}marker{random.Random(tenant).randrange(10**8):08d}"
        doc = f"The private ledger of {marker} lists {marker}-vault contents. " + " ".join(
            SENTENCES[:3]
        )
        prompt = f"Memo {marker}: " + long_text(1) + "\nSummary:"
        private[tenant] = [marker, doc[:60], prompt[:60], tenant_tag(tenant)]
        for spec in (
            {"kind": "completion", "prompt": prompt},
            {
                "kind": "rag",
                "documents": [doc],
                "messages": [{"role": "user", "content": f"What is {marker}?"}],
            },
            {"kind": "responses", "instructions": marker, "input": prompt},
        ):
            _, text, _ = send(c, spec)
            seen.add(tenant, "private", text)
    return private


def probe_everything(server, seen, private) -> None:
    """What every tenant can read that is not its own generation: stats, metrics, errors."""
    for tenant in TENANTS:
        r = httpx.get(server.base_url + "/kv/stats", headers=headers(tenant), timeout=60)
        assert r.status_code == 200
        seen.add(tenant, "/v1/kv/stats", r.text)
        r = httpx.get(server.url + "/metrics", timeout=60)
        assert r.status_code == 200 and "kvfuse_" in r.text
        seen.add(tenant, "/metrics", r.text)
        for body in (
            {"model": MODEL, "prompt": "x", "n": 0},  # 400s of every kind
            {"model": MODEL, "prompt": "x", "max_tokens": 10**9},
            {"model": MODEL, "prompt": "x", "recompute_ratio": 0.5},
            {"model": "not-a-model", "prompt": "x"},
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        ):
            path = "/chat/completions" if "messages" in body else "/completions"
            r = httpx.post(server.base_url + path, json=body, headers=headers(tenant), timeout=60)
            assert 400 <= r.status_code < 500, r.text
            seen.add(tenant, f"error {r.status_code}", r.text)
        r = httpx.get(server.base_url + "/responses/resp_nope", headers=headers(tenant), timeout=60)
        assert r.status_code == 404
        seen.add(tenant, "404", r.text)


def check_delete_isolation(server, clients, specs, seen) -> None:
    """Bob clears his KV: his repeat computes everything again, alice's and carol's still hit."""
    r = httpx.delete(server.base_url + "/kv", headers=headers("bob"), timeout=120)
    assert r.status_code == 200
    out = r.json()
    seen.add("bob", "DELETE /v1/kv", r.text)
    assert out["tenant"] == "bob" and sum(out["deleted"].values()) > 0
    spec = next(s for s in specs if s["kind"] == "completion")
    assert send(clients["bob"], spec)[0] == 0
    for tenant in ("alice", "carol"):
        assert send(clients[tenant], spec)[0] > 0, f"{tenant}'s entries went with bob's"


def check_signing(server) -> None:
    """Every entry the server wrote to disk is signed by the first key; nothing was refused (every
    entry read back was its own); no key in the log."""
    files = list(server.kv_dir.rglob("*.kvf"))
    assert files, "no entries on disk"
    signer = EntrySigner([SIGNING_KEYS[0].encode()])
    assert {read_header(f.read_bytes(), signer).signature for f in files} == {"valid"}
    stats = httpx.get(server.base_url + "/kv/stats", headers=headers("alice"), timeout=60).json()[
        "tiers"
    ]["store"]
    assert (
        stats["signature_unsigned"] == stats["signature_mismatch"] == stats["unusable_entries"] == 0
    )
    log = server.log_path.read_text(errors="replace")
    assert not [k for k in SIGNING_KEYS if k in log], "a signing key is in the server's log"


def scan(seen: Seen, private: dict[str, list[str]]) -> None:
    """No body a tenant received holds another tenant's markers, texts, name, tag, or any key.
    (Names are looked for outside generated text only, where a model could say "bob" by itself.)"""
    leaks = []
    for tenant, bodies in seen.bodies.items():
        others = [t for t in TENANTS if t != tenant]
        for body in bodies:
            generated = body.startswith(("first", "repeat", "private", "follow-up"))
            needles = [n for t in others for n in private[t][:3]] + (
                [] if generated else [f'"{t}"' for t in others]
            )
            for needle in needles:
                if needle in body:
                    leaks.append(f"{tenant} saw {needle!r} in {body[:200]!r}")
            for t in others:  # a tenant's tag starts every storage key of its entries
                if re.search(rf"(?<![0-9a-f]){private[t][3]}", body):
                    leaks.append(f"{tenant} saw {t}'s tenant tag in {body[:200]!r}")
            for m in KEY_RE.findall(body) + HEX64_RE.findall(body):
                leaks.append(f"{tenant} saw a key or digest {m!r} in {body[:120]!r}")
            leaks += [
                f"{tenant} saw a signing key in {body[:120]!r}" for k in SIGNING_KEYS if k in body
            ]
    assert not leaks, "\n".join(leaks[:20])
    for tenant, bodies in seen.bodies.items():  # the scan looked at everything each tenant can see
        kinds = {b.split(":", 1)[0].split(" ")[0] for b in bodies}
        assert {
            "first",
            "repeat",
            "private",
            "/v1/kv/stats",
            "/metrics",
            "error",
            "404",
        } <= kinds, (tenant, kinds)
        assert len(bodies) >= 25, (tenant, len(bodies))
