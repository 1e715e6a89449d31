"""Our tokenizer wrapper against transformers' tokenizer on the same converted folders."""

from __future__ import annotations

import pytest

from kvfuse.models import Tokenizer
from kvfuse.models.registry import pull
from kvfuse.models.tokenizer import ChatTemplateError

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Ünïcödé, 日本語のテキスト, emoji 🚀🔥 and numbers 1234567890.",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # comment\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ],
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def folders(request, kvfuse_home):
    from transformers import AutoTokenizer

    folder = pull(request.param, kvfuse_home)
    return request.param, Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


def test_encode_decode_match_transformers(folders):
    _, ours, ref = folders
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert (
            ours.encode(text, add_special_tokens=False)
            == ref(text, add_special_tokens=False)["input_ids"]
        )


def test_chat_template_matches_transformers(folders):
    _, ours, ref = folders
    for messages in CHATS:
        text = ours.render_chat(messages)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(messages) == ref(text, add_special_tokens=False)["input_ids"]


def test_template_errors_are_clear(folders):
    name, ours, _ = folders
    if name == "gemma3-270m":
        with pytest.raises(ChatTemplateError, match="alternate"):
            ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
