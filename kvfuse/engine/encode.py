"""Text -> token ids for prompts with documents, the same for the server, the CLI and precompute.

A document is tokenized on its own (its text stripped, then a blank line, no special tokens), so
its ids, and therefore its cache key, do not depend on where it is used. For a completion the
prompt is ``[special tokens][documents...][prompt text]``; for a chat the documents go at the
start of the last user message: the template is rendered around a marker, and everything before
the marker is the prefix, everything after it the suffix.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfuse.models.tokenizer import Tokenizer

from .prompt import Prompt

_MARKER = "\x00kvfuse-documents\x00"


def encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of one document; ValueError if it is empty."""
    text = text.strip()
    if not text:
        raise ValueError("the document is empty")
    return tokenizer.encode(text + "\n\n", add_special_tokens=False)


def encode_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> list[list[int]]:
    out = []
    for i, doc in enumerate(documents):
        try:
            out.append(encode_document(tokenizer, doc))
        except ValueError as e:
            raise ValueError(f"document {i}: {e}") from None
    return out


def completion_prompt(tokenizer: Tokenizer, documents: Sequence[str], text: str) -> Prompt:
    """``[special tokens][documents][text]`` (the special tokens a plain prompt would start with)."""
    prefix = tokenizer.encode("")  # e.g. Gemma's BOS; nothing for a tokenizer that adds none
    return Prompt.of(prefix, encode_documents(tokenizer, documents), tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer: Tokenizer, documents: Sequence[str], messages: list[dict]) -> Prompt:
    """The chat ``messages`` with ``documents`` at the start of the last user message."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("documents go into the last user message, and there is none")
    marked = [dict(m) for m in messages]
    marked[last]["content"] = _MARKER + (marked[last].get("content") or "")
    rendered = tokenizer.render_chat(marked)
    if rendered.count(_MARKER) != 1:
        raise ValueError("this chat template does not keep message text as it is; send the documents to "
                         "/v1/completions instead")
    before, after = rendered.split(_MARKER)
    return Prompt.of(tokenizer.encode(before, add_special_tokens=False), encode_documents(tokenizer, documents),
                     tokenizer.encode(after, add_special_tokens=False))
