"""Text -> token ids for prompts with documents, the same for the server, the CLI and precompute.

A document is tokenized on its own (its text stripped, then a blank line, no special tokens), so
its ids, and therefore its cache key, do not depend on where it is used. For a completion the
prompt is ``[special tokens][documents...][prompt text]``; for a chat the documents go at the
start of the last user message: the template is rendered around a marker, and everything before
the marker is the prefix, everything after it the suffix. What clients wrote (documents, message
contents) is tokenized with control-token text kept as text (``prompts.control``). Cache breakpoints on message parts
(``breakpoint_positions``) are found the same way: markers at the parts' ends, then the tokens of
the rendered prompt that lie wholly before each.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfuse.models.tokenizer import Tokenizer

from .control import encode_rendered, message_texts
from .prompt import Prompt

_MARKER = "\x00kvfuse-documents\x00"


def check_chat_size(messages: Sequence[dict], max_messages: int, max_chars: int) -> None:
    """ValueError naming the limit when chat ``messages`` are more than ``max_messages`` or their
    text (every string in them: contents, parts, tool calls) more than ``max_chars`` characters.
    Checked before anything is rendered: a template renders whatever it is given, and the cost of
    rendering and tokenizing grows with it (``server.max_chat_messages``, ``max_chat_chars``)."""
    if len(messages) > max_messages:
        raise ValueError(
            f"the conversation has {len(messages)} messages; at most {max_messages} are accepted "
            "(server.max_chat_messages)"
        )
    chars, stack = 0, list(messages)
    while stack:  # no recursion: a deeply nested body must not exhaust the stack
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        if chars > max_chars:
            raise ValueError(
                f"the conversation's text is over {max_chars} characters; at most {max_chars} "
                "are accepted (server.max_chat_chars)"
            )


def encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of one document; ValueError if it is empty."""
    text = text.strip()
    if not text:
        raise ValueError("the document is empty")
    ids = tokenizer.encode(text + "\n\n", add_special_tokens=False)
    if any(t in tokenizer.special_ids for t in ids):  # a client's text: control-token text in
        return tokenizer.encode_plain(text + "\n\n")  # it stays text (prompts.control)
    return ids


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
    return Prompt.of(
        prefix,
        encode_documents(tokenizer, documents),
        tokenizer.encode(text, add_special_tokens=False),
    )


def chat_prompt(
    tokenizer: Tokenizer,
    documents: Sequence[str],
    messages: list[dict],
    tools: list[dict] | None = None,
) -> Prompt:
    """The chat ``messages`` with ``documents`` at the start of the last user message (``tools``:
    the template's tools argument)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("documents go into the last user message, and there is none")
    marked = [dict(m) for m in messages]
    marked[last]["content"] = _MARKER + (marked[last].get("content") or "")
    rendered = tokenizer.render_chat(marked, tools=tools)
    if rendered.count(_MARKER) != 1:
        raise ValueError(
            "this chat template does not keep message text as it is; send the documents to "
            "/v1/completions instead"
        )
    before, after = rendered.split(_MARKER)
    return Prompt.of(  # the contents' control-token text stays text (prompts.control)
        encode_rendered(tokenizer, before, message_texts(messages[:last])),
        encode_documents(tokenizer, documents),
        encode_rendered(tokenizer, after, message_texts(messages[last:])),
    )


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The ids of chat ``messages`` rendered by the template, with the control-token text of
    their contents kept as text (``prompts.control``; ControlTextError where it cannot be)."""
    rendered = tokenizer.render_chat(messages, add_generation_prompt, tools)
    return encode_rendered(tokenizer, rendered, message_texts(messages))


def breakpoint_positions(
    tokenizer: Tokenizer,
    messages: list[dict],
    marks: Sequence[tuple[int, int]],
    ids: Sequence[int],
    tools: list[dict] | None = None,
) -> list[int | None]:
    """For each mark ``(message index, character offset in its content)``, how many leading tokens
    of ``ids`` (the rendered ``messages``' ids) lie wholly before it: the prompt prefix a cache
    breakpoint there stores. None for a mark the template does not keep verbatim (it changes the
    text around it), or when ``ids`` are not the plain rendering (e.g. a truncated conversation)."""
    if not marks:
        return []
    marked = [dict(m) for m in messages]
    # Insert right to left within a message, so that the offsets of the others stay valid.
    for i in sorted(range(len(marks)), key=lambda i: (marks[i][0], -marks[i][1])):
        m, c = marks[i]
        content = marked[m].get("content") or ""
        marked[m]["content"] = content[:c] + _mark(i) + content[c:]
    rendered = tokenizer.render_chat(marked, tools=tools)
    clean = tokenizer.render_chat(messages, tools=tools)
    found = sorted((rendered.find(_mark(i)), i) for i in range(len(marks)))
    chars: dict[int, int] = {}
    removed = 0
    for at, i in found:
        if at < 0 or rendered.count(_mark(i)) != 1:
            continue
        pos = at - removed
        removed += len(_mark(i))
        chars[i] = pos
    plain, offsets = tokenizer.encode_offsets(clean, add_special_tokens=False)
    if list(plain) != list(ids):
        return [None] * len(marks)
    out: list[int | None] = []
    for i in range(len(marks)):
        pos = chars.get(i)
        if pos is None or _unmark(rendered, len(marks))[:pos] != clean[:pos]:
            out.append(None)
            continue
        n = 0
        while n < len(offsets) and offsets[n][1] <= pos:
            n += 1
        out.append(n or None)
    return out


def _mark(i: int) -> str:
    return f"\x00kvfuse-breakpoint-{i}\x00"


def _unmark(text: str, n: int) -> str:
    for i in range(n):
        text = text.replace(_mark(i), "")
    return text
