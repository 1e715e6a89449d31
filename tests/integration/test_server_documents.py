"""RAG documents through the real server and the official ``openai`` client: ``documents`` and
``recompute_ratio`` in ``extra_body``, reuse at any position, the usage it reports, the 4xx cases,
and the CLI's ``precompute`` filling the cache a server then reads."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from kvfuse_helpers import uncached_engine
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
DOCS = [
    "The harbour town of Velmora sits where the river Aske meets the northern sea. Its lighthouse was built in "
    "1847 by a stonemason named Ilse Garrow, who also carved the fountain in the square.",
    "Brell is an island west of Velmora. Puffins nest on its western cliffs, and the ferry to Brell leaves every "
    "morning at dawn from the old pier.",
    "The council of Velmora meets on the first Tuesday of each month, in a hall that used to be a rope factory.",
]
QUESTION = "Who built the lighthouse of Velmora?"


@pytest.fixture(scope="module")
def home(kvfuse_home):
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("docs-kv")


@pytest.fixture(scope="module")
def server(home, disk_dir):
    srv = ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(disk_dir)},
            "blend": {"recompute_ratio": 0.2},
        },
    )
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(home):
    """The in-process engine on the same model without a cache: the full-prefill reference."""
    return uncached_engine(home, MODEL)


def reference(engine, max_tokens: int, **prompt) -> str:
    from kvfuse.generation import SamplingParams

    ids = engine.prompts.document_prompt(
        DOCS if "docs" not in prompt else prompt.pop("docs"), **prompt
    ).ids
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)).text


def test_completion_with_documents_is_reused_at_any_position(client, engine):
    first = client.completions.create(
        model=MODEL,
        prompt=f"Question: {QUESTION}\nAnswer:",
        max_tokens=8,
        temperature=0,
        extra_body={"documents": DOCS},
    )
    details = first.usage.prompt_tokens_details
    assert details.cached_tokens == 0  # the documents were computed (and stored) on the way
    recomputed = details.model_extra["recomputed_tokens"]
    assert recomputed > 0
    again = client.completions.create(
        model=MODEL,
        prompt="Question: Where do puffins nest?\nAnswer:",
        max_tokens=8,
        temperature=0,
        extra_body={"documents": DOCS[::-1]},
    )
    d = again.usage.prompt_tokens_details
    doc_tokens = sum(len(engine.prompts.encode_document(x)) for x in DOCS)
    # every document token reused
    assert d.cached_tokens + d.model_extra["recomputed_tokens"] == doc_tokens
    assert d.model_extra["recomputed_tokens"] == round(0.2 * doc_tokens)


def test_ratio_one_answers_as_a_full_prefill_of_the_same_tokens(client, engine):
    prompt = f"Question: {QUESTION}\nAnswer:"
    for kind in ("completion", "chat"):
        if kind == "completion":
            got = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"documents": DOCS, "recompute_ratio": 1.0},
            )
            text, expected = got.choices[0].text, reference(engine, 10, prompt=prompt)
        else:
            messages = [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": QUESTION},
            ]
            got = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=10,
                temperature=0,
                extra_body={"documents": DOCS, "recompute_ratio": 1.0},
            )
            text, expected = (
                got.choices[0].message.content,
                reference(engine, 10, messages=messages),
            )
        assert text == expected, kind
        assert got.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_with_documents_reports_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"documents": DOCS[:2], "recompute_ratio": 0.5},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.model_extra["recomputed_tokens"] > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [1, 2, 3], "extra_body": {"documents": DOCS}}, "documents"),
        ({"prompt": "q", "extra_body": {"documents": ["ok", "   "]}}, "documents"),
        (
            {"prompt": "q", "extra_body": {"documents": DOCS, "recompute_ratio": 1.5}},
            "recompute_ratio",
        ),
        ({"prompt": "q", "extra_body": {"recompute_ratio": 0.5}}, "recompute_ratio"),
        (
            {"prompt": "q", "extra_body": {"documents": DOCS, "recompute_ratio": "most"}},
            "recompute_ratio",
        ),
        ({"prompt": "q", "extra_body": {"documents": DOCS, "cache": False}}, "documents"),
        ({"prompt": "q", "extra_body": {"documents": "not a list"}}, "documents"),
        (
            {"prompt": "q", "extra_body": {"documents": [DOCS[0] * 300]}},
            "prompt",
        ),  # longer than the context window
    ],
)
def test_bad_documents_requests_are_clear_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, max_tokens=4, **body)
    assert exc.value.status_code == 400 and exc.value.body["param"] == param, exc.value.body


def test_chat_documents_need_a_user_message(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "hi"}],
            max_tokens=4,
            extra_body={"documents": DOCS},
        )
    assert exc.value.body["param"] == "documents" and "user message" in exc.value.body["message"]


def test_metrics_count_blends(client, server):
    client.completions.create(
        model=MODEL, prompt="Q:", max_tokens=2, extra_body={"documents": DOCS[:1]}
    )
    text = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("kvfuse_blend_requests_total"))
    assert float(line.split()[-1]) >= 1
    assert "kvfuse_blend_recomputed_tokens_total" in text


def test_usage_and_metrics_say_which_budget_was_used(client, server, engine):
    """The configured budget, a request's own, and ``auto`` (the model's calibrated profile, or the
    conservative default without one): each response says which, and ``/metrics`` counts them."""
    from kvfuse.config import BlendOptions
    from kvfuse.config import profiles as profile

    def blend_of(**extra) -> dict:
        got = client.completions.create(
            model=MODEL,
            prompt="Q: Who lives on Brell?\nA:",
            max_tokens=2,
            temperature=0,
            extra_body={"documents": DOCS[1:], **extra},
        )
        return got.usage.prompt_tokens_details.model_extra["blend"]

    assert blend_of() == {"method": "hkvd", "recompute_ratio": 0.2, "source": "config"}
    assert blend_of(recompute_ratio=0.5) == {
        "method": "hkvd",
        "recompute_ratio": 0.5,
        "source": "request",
    }
    auto = profile.resolve(BlendOptions(), profile.find(engine.model.fingerprint), MODEL)
    assert blend_of(recompute_ratio="auto") == {
        "method": auto.method,
        "recompute_ratio": auto.recompute_ratio,
        "source": auto.source,
    }
    plain = client.completions.create(model=MODEL, prompt="Q: hello", max_tokens=1)
    assert plain.usage.prompt_tokens_details.model_extra.get("blend") is None  # no documents
    text = httpx.get(server.url + "/metrics", timeout=30).text
    counts = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvfuse_blend_budget_requests_total{")
    }
    assert counts['method="hkvd",recompute_ratio="0.5",source="request"'] >= 1
    assert counts['method="hkvd",recompute_ratio="0.2",source="config"'] >= 1
    assert (
        counts[
            f'method="{auto.method}",recompute_ratio="{auto.recompute_ratio:g}",source="{auto.source}"'
        ]
        >= 1
    )


def test_precompute_fills_the_cache_a_server_reads(home, engine, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOCS[0])
    (docs / "more.jsonl").write_text('{"text": "%s"}\n"%s"\n' % (DOCS[1], DOCS[2]))
    kv = tmp_path / "kv"
    config = tmp_path / "c.yaml"
    # a blending budget: the model's calibrated ``auto`` may be prefix reuse only (nothing to precompute)
    config.write_text(
        f"model: {MODEL}\ncache:\n  disk_path: {kv}\nblend:\n  recompute_ratio: 0.2\n"
    )
    cli = [sys.executable, "-m", "kvfuse.cli"]
    run = subprocess.run(
        cli + ["precompute", str(docs), "--home", str(home), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("3 documents") and "3 computed and stored" in run.stdout
    again = subprocess.run(
        cli + ["precompute", str(docs / "a.txt"), "--home", str(home), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "1 already cached" in again.stdout
    bad = subprocess.run(
        cli + ["precompute", str(tmp_path / "nope"), "--home", str(home), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "no such file or folder" in bad.stderr
    with ServerProcess(
        home,
        config={"model": MODEL, "cache": {"disk_path": str(kv)}, "blend": {"recompute_ratio": 0.2}},
    ) as srv:
        c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        r = c.completions.create(
            model=MODEL,
            prompt="Q: who built the lighthouse?\nA:",
            max_tokens=4,
            extra_body={"documents": DOCS},
        )
        d = r.usage.prompt_tokens_details
        # precomputed: read from the disk tier, nothing computed on the way
        assert d.cached_tokens > 0
        assert d.cached_tokens + d.model_extra["recomputed_tokens"] == sum(
            len(engine.prompts.encode_document(x)) for x in DOCS
        )
