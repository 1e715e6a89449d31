"""Control-token text in what clients write stays text.

A chat template renders message contents into one string, and tokenizing that string turns any
special-token text in it into the real token: a user message holding
``"<|im_end|>\\n<|im_start|>system\\n..."`` would end its own turn and open a system turn. So the
contents' characters are tokenized as plain text (HF's ``split_special_tokens``,
``Tokenizer.encode_plain``) while the template's own text keeps its control tokens.

How: the rendered prompt is tokenized as before; only when a special token lands inside a
message's content is the prompt tokenized again in pieces: the template's text between contents
as before, each content with ``encode_plain``. Contents are found in the rendering in message
order (as they are, or stripped, for templates that ``trim`` them). A prompt without control-token
text in its contents (every ordinary one) keeps exactly the ids it had, so its cache keys do not
change; a spliced one may tokenize differently at a content's edges, which only such prompts see.
A content holding control-token text that the template changed beyond stripping cannot be told
apart from the template's text: ``ControlTextError`` (the server's 400), never real tokens.

Why not render with placeholders and splice the contents' ids in always (what a strict reading
of the fix suggests): that changes the ids of ordinary prompts at every content's edges (BPE
merges across them), hence every cache key, and breaks templates that look at the content. vLLM
and ``transformers.apply_chat_template`` tokenize the rendered string as a whole (the control
tokens pass); ``split_special_tokens`` is transformers' switch for plain text, used here per piece.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvfuse.models.tokenizer import ChatTemplateError


class ControlTextError(ChatTemplateError):
    """A message's content holds control-token text where the prompt cannot keep it as text
    (a ``ChatTemplateError``: the server's 400 for what the template cannot render)."""


class _Tokenizer(Protocol):
    special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]: ...

    def encode_plain(self, text: str) -> list[int]: ...


def message_texts(messages: Sequence[dict]) -> list[str]:
    """The client-written texts of chat ``messages``, in order: string contents and the ``text``
    of content parts."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return [t for t in out if t]


def content_spans(text: str, contents: Iterable[str]) -> tuple[list[tuple[int, int]], list[str]]:
    """Where ``contents`` lie in ``text``, looked for in order (each after the previous one found),
    as they are or stripped; and the contents not found (a template that changed them)."""
    spans, missing, cursor = [], [], 0
    for c in contents:
        for needle in (c, c.strip()):
            at = text.find(needle, cursor) if needle else -1
            if at >= 0:
                spans.append((at, at + len(needle)))
                cursor = at + len(needle)
                break
        else:
            missing.append(c)
    return spans, missing


def specials_inside(
    offsets: Sequence[tuple[int, int]],
    ids: Sequence[int],
    special: frozenset[int],
    spans: Sequence[tuple[int, int]],
) -> bool:
    """Whether a special token of ``ids`` (character ``offsets``) lies inside one of ``spans``
    (sorted, disjoint): a bisection per special token, so a long conversation costs little."""
    starts = [s for s, _ in spans]
    for t, (a, b) in zip(ids, offsets):
        if t in special:
            i = bisect.bisect_right(starts, a) - 1
            if i >= 0 and b <= spans[i][1]:
                return True
    return False


def pieces(text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[str, bool]]:
    """``text`` cut at ``spans`` (sorted, disjoint): ``(piece, is_content)`` in order, no empty ones."""
    out, at = [], 0
    for s, e in spans:
        out += [(text[at:s], False), (text[s:e], True)]
        at = e
    out.append((text[at:], False))
    return [(p, c) for p, c in out if p]


def encode_rendered(tok: _Tokenizer, text: str, contents: Sequence[str]) -> list[int]:
    """The ids of ``text`` (a rendered prompt, or part of one, holding ``contents``): as the
    tokenizer gives them, unless a control token lies inside a content; then the contents are
    tokenized as plain text (see the module docstring). ``ControlTextError`` for a content that
    holds control-token text and is not found in ``text``."""
    ids, offsets = tok.encode_offsets(text, add_special_tokens=False)
    special = tok.special_ids
    if not any(t in special for t in ids):
        return ids
    spans, missing = content_spans(text, contents)
    for c in missing:
        if any(t in special for t in tok.encode(c, add_special_tokens=False)):
            raise ControlTextError(
                "a message's content holds control-token text, and this chat template does not "
                "keep that content as it is, so it cannot be kept as text; remove the "
                "control-token text"
            )
    if not specials_inside(offsets, ids, special, spans):
        return ids
    out: list[int] = []
    for piece, is_content in pieces(text, spans):
        out += (
            tok.encode_plain(piece) if is_content else tok.encode(piece, add_special_tokens=False)
        )
    return out
