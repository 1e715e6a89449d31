"""Truncating a conversation that outgrows the context window: the cut found with O(log turns)
renders gives the same kept turns and ids as the reference scan over every cut, and a chat over
the size limits is refused before anything is rendered."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from kvfuse.models.tokenizer import Tokenizer
from kvfuse.prompts import PromptBuilder
from kvfuse.prompts.truncate import drop_oldest_turns, first_fitting

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer (one id per word) with a ChatML-like template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant", "tool"]
    words += [f"w{i}" for i in range(200)]
    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return Tokenizer(folder)


class Counting:
    """A tokenizer that counts the chats it renders and tokenizes."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.renders = tok, 0

    def encode_chat(self, messages, add_generation_prompt=True, tools=None):
        self.renders += 1
        return self.tok.encode_chat(messages, add_generation_prompt, tools=tools)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def builder(tok, window: int, **limits) -> PromptBuilder:
    model = SimpleNamespace(
        tokenizer=tok, config=SimpleNamespace(vocab_size=207, max_position_embeddings=window)
    )
    return PromptBuilder(model, window, **limits)


def reference(tok, messages, reserve, window) -> tuple[list[int], int]:
    """What ``encode_chat`` answered before: every cut tried, oldest first."""
    ids = tok.encode_chat(messages)
    if len(ids) + reserve <= window:
        return ids, 0
    kept = drop_oldest_turns(messages, lambda m: len(tok.encode_chat(m)) + reserve <= window)
    if kept is None:
        return ids, 0
    return tok.encode_chat(kept), len(messages) - len(kept)


def conversation(rng: random.Random) -> list[dict]:
    out = [{"role": "system", "content": "w1 w2"}] * rng.randint(0, 2)
    for _ in range(rng.randint(0, 30)):
        out.append({"role": "user", "content": " ".join(["w3"] * rng.randint(0, 40))})
        for role in rng.choice([["assistant"], ["assistant", "tool", "assistant"], []]):
            out.append({"role": role, "content": " ".join(["w4"] * rng.randint(0, 60))})
    if rng.random() < 0.8:
        out.append({"role": "user", "content": " ".join(["w5"] * rng.randint(0, 80))})
    return out


@pytest.mark.parametrize(
    "n,first",
    [(0, None), (1, None), (1, 0), (2, 1), (5, 0), (5, 4), (7, 3), (100, 37), (100, None), (1, 0)],
)
def test_first_fitting_finds_the_first_cut_that_fits_with_few_calls(n, first):
    asked = []

    def fits(i):
        assert i not in asked and 0 <= i < n  # never twice, never out of range
        asked.append(i)
        return first is not None and i >= first

    assert first_fitting(n, fits) == first
    assert len(asked) <= 2 * max(1, n).bit_length() + 2


def test_first_fitting_matches_a_scan_on_every_threshold():
    for n in range(0, 40):
        for first in [None, *range(n)]:
            got = first_fitting(n, lambda i: first is not None and i >= first)
            assert got == first, (n, first)


def test_truncation_keeps_the_same_turns_and_ids_as_every_cut_tried(tokenizer):
    rng = random.Random(39)
    for trial in range(150):
        messages = conversation(rng)
        if not messages:
            continue
        window, reserve = rng.randint(8, 400), rng.randint(0, 40)
        got = builder(tokenizer, window).encode_chat(messages, reserve)
        assert got == reference(tokenizer, messages, reserve, window), trial


def test_a_long_chat_whose_last_message_never_fits_costs_few_renders(tokenizer):
    """The old rule rendered the rest of the conversation once per cut: turns^2 / 2 messages."""
    messages = [{"role": "system", "content": "w1"}]
    for _ in range(2000):
        messages += [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]
    messages.append({"role": "user", "content": " ".join(["w5"] * 500)})
    tok = Counting(tokenizer)
    ids, dropped = builder(tok, 256).encode_chat(messages, 16)
    assert dropped == 0 and ids == tokenizer.encode_chat(messages)  # nothing fits: check says so
    assert tok.renders <= 4
    messages[-1] = {"role": "user", "content": "w5"}  # now the last turns fit: a cut is found
    tok.renders = 0
    ids, dropped = builder(tok, 256).encode_chat(messages, 16)
    assert tok.renders <= 2 * 12 + 3
    kept = messages[:1] + messages[1 + dropped :]
    assert ids == tokenizer.encode_chat(kept) and len(ids) + 16 <= 256
    assert len(tokenizer.encode_chat(messages[:1] + messages[dropped - 1 :])) + 16 > 256


@pytest.mark.parametrize(
    "messages,limit",
    [
        ([{"role": "user", "content": "w3"}] * 11, "server.max_chat_messages"),
        ([{"role": "user", "content": "w3 " * 40}], "server.max_chat_chars"),
        ([{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}], "max_chat_chars"),
    ],
)
def test_a_chat_over_the_limits_is_refused_before_it_is_rendered(tokenizer, messages, limit):
    tok = Counting(tokenizer)
    b = builder(tok, 1000, max_messages=10, max_chars=100)
    with pytest.raises(ValueError, match=limit):
        b.encode_chat(messages)
    with pytest.raises(ValueError, match=limit):
        b.encode_prompt(messages=messages)
    assert tok.renders == 0
    assert b.encode_chat(messages[:1] if len(messages) > 1 else [messages[0] | {"content": "w3"}])
