"""What a response says about reuse (server.disclosure): whole chunks unless the request names its
conversation; the history scope of an end user."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfuse.config import Config
from kvfuse.engine import GenerationResult, Outcome
from kvfuse.kv.keys import Namespace
from kvfuse.reuse.keying import history_scope
from kvfuse.server.disclosure import coarse, exact_for, names_conversation, reported


def result(**kw) -> GenerationResult:
    base = dict(text="", token_ids=[1], finish_reason="stop", prompt_tokens=300)
    return GenerationResult(**{**base, **kw})


@pytest.mark.parametrize(
    "cached, prefix, span, tiers, written, expect",
    [
        (67, 67, 0, ("memory", "disk"), 233, (64, 64, 0, ("memory",), 192)),
        (130, 60, 70, ("memory",) * 3, 0, (128, 60, 68, ("memory",) * 2, 0)),
        (63, 63, 0, ("disk",), 237, (0, 0, 0, (), 192)),
        (128, 128, 0, ("disk",) * 2, 64, (128, 128, 0, ("disk",) * 2, 64)),
    ],
)
def test_coarse_rounds_every_reuse_figure_down_to_whole_chunks(
    cached, prefix, span, tiers, written, expect
):
    r = coarse(
        result(
            cached_tokens=cached,
            prefix_reused_tokens=prefix,
            span_reused_tokens=span,
            hit_tiers=tiers,
            written_tokens=written,
        ),
        64,
    )
    got = (r.cached_tokens, r.prefix_reused_tokens, r.span_reused_tokens, r.hit_tiers)
    assert got + (r.written_tokens,) == expect
    assert r.prompt_tokens == 300 and r.token_ids == [1]


def body(**kw):
    return SimpleNamespace(
        **{"prompt_cache_key": None, "previous_response_id": None, "user": None, **kw}
    )


def test_only_a_request_naming_its_conversation_is_told_exactly():
    assert not names_conversation(body()) and not names_conversation(SimpleNamespace())
    for named in ({"prompt_cache_key": "k"}, {"previous_response_id": "resp_1"}, {"user": "u"}):
        assert names_conversation(body(**named)) and exact_for(body(**named), "chunk")
    assert exact_for(body(), "exact") and not exact_for(body(), "chunk")
    assert Config().server.cached_tokens == "chunk"  # the default
    out = Outcome(result=result(cached_tokens=100))
    assert reported(out, False, 64).result.cached_tokens == 64
    assert reported(out, True, 64) is out
    failed = Outcome(error=ValueError("x"))
    assert reported(failed, False, 64) is failed


def test_each_end_user_has_a_history_scope_of_its_own_inside_the_namespace():
    ns = Namespace("model", "float16", "L2xH1xD4")
    plain = history_scope(ns, None)
    assert plain == ns.key_prefix() == history_scope(ns, "")
    a, b = history_scope(ns, "alice"), history_scope(ns, "bob")
    assert a != b and a.startswith(plain) and b.startswith(plain)  # a tenant's clear covers them
    assert "alice" not in a
