"""Logprobs in the APIs' shapes, from the engine's ``TokenLogprob`` entries (pure, given the
token texts).

- chat completions and the Responses API: ``{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}`` per token (``top_logprobs``: exactly the N most likely);
- legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where a
  position's ``top_logprobs`` maps the N most likely tokens' texts, and the chosen one's, to their
  logprobs (as vLLM: N or N + 1 entries), and ``text_offset`` is each token's character offset in
  the choice's text. With ``echo`` the prompt's tokens come first, the first with null logprobs.

A token's ``bytes`` are its exact bytes (a byte-level token may hold part of a UTF-8 character:
its ``token`` text then shows U+FFFD where the bytes are incomplete). A logprob of ``-inf`` (a
token the raw distribution gives no mass, after a bias or constraint picked it) is reported as
-9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvfuse.sampling import TokenLogprob

FLOOR = -9999.0


class TokenTexts:
    """The text and bytes of each token id of one tokenizer (its ``token_bytes`` table when it
    has an exact one, else each id decoded alone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._table = tokenizer.token_bytes()

    def bytes_of(self, token: int) -> bytes:
        if self._table is not None and 0 <= token < len(self._table):
            return self._table[token]
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="replace")


def logprob_value(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _item(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    b = texts.bytes_of(token)
    return {
        "token": b.decode("utf-8", errors="replace"),
        "logprob": logprob_value(logprob),
        "bytes": list(b),
    }


def chat_content(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's (and the Responses API's) per-token entries."""
    return [
        {
            **_item(texts, e.token, e.logprob),
            "top_logprobs": [_item(texts, t, lp) for t, lp in e.top],
        }
        for e in entries
    ]


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {"content": chat_content(texts, entries), "refusal": None}


def legacy_logprobs(
    texts: TokenTexts, entries: Sequence[TokenLogprob | None], tokens: Sequence[int], offset: int
) -> dict[str, Any]:
    """Legacy completions' ``logprobs`` of ``tokens`` (``entries[i]`` scores ``tokens[i]``; None:
    the prompt's first token), their text offsets starting at ``offset``."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token, e in zip(tokens, entries):
        text = texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(logprob_value(e.logprob))
        top = {texts.text(t): logprob_value(lp) for t, lp in e.top}
        top.setdefault(text, logprob_value(e.logprob))
        out["top_logprobs"].append(top)
    return out


def legacy_end(logprobs: dict[str, Any], start: int) -> int:
    """The text offset after the last token of a legacy ``logprobs`` object (``start`` when it
    has none): where the next chunk's offsets continue."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
