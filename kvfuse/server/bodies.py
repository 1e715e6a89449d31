"""Response bodies and server-sent-event chunks, built from an engine ``GenerationResult``.

Streaming follows what the official OpenAI clients parse: one ``data: {json}\\n\\n`` event per chunk
(``text_completion`` or ``chat.completion.chunk`` objects), a chunk carrying ``finish_reason``,
with ``stream_options.include_usage`` a last chunk whose ``choices`` is empty and ``usage`` set,
then ``data: [DONE]\\n\\n``. With ``n`` choices each chunk carries one choice (its ``index``), and
the finish reasons come last, a chunk per choice. An error after the stream started is sent as
``data: {"error": ...}`` (the clients raise it) and the stream ends without [DONE].

With tools (``kvfuse.tools``), each choice's output is parsed: the message gets ``tool_calls``
(and ``content`` null when it was only calls), the finish reason is ``tool_calls``; a stream sends
the text before a call as ``content`` deltas and each call as it is generated, as OpenAI does: a
delta ``tool_calls[0] = {index, id, type: "function", function: {name, arguments: ""}}`` once its
name is read, then deltas ``{index, function: {arguments: <piece>}}`` as its arguments grow
(``kvfuse.tools.CallParser``). A call that breaks off after it started (invalid JSON, or cut by
``max_tokens``) keeps what was sent; the finish reason is then ``tool_calls`` (``length`` when
cut). A token's logprobs go with the next chunk of its choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfuse.engine import Choice, Delta, GenerationResult
from kvfuse.tools import CallArgs, CallStart, Parsed, Text, ToolCalling

from .logprobs import TokenTexts, chat_content, chat_logprobs, legacy_end, legacy_logprobs

SSE_DONE = "data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(result: GenerationResult | Choice, called: bool = False) -> str:
    """OpenAI's finish reason (the caller handles "cancelled" as an error before getting here):
    ``length`` when cut short, else ``tool_calls`` when the output made calls."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def assistant_message(parsed: Parsed) -> dict[str, Any]:
    """The chat message of a parsed output (``content`` null when it was only calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [c.openai() for c in parsed.calls]
    return message


def usage(result: GenerationResult) -> dict[str, Any]:
    details = {
        "cached_tokens": result.cached_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "prefix_reused_tokens": result.prefix_reused_tokens,
        "span_reused_tokens": result.span_reused_tokens,
        "prefilled_tokens": result.prompt_tokens - result.cached_tokens,
        "auto_reuse": result.auto_reuse,
        "cached_entries_by_tier": {
            t: result.hit_tiers.count(t) for t in sorted(set(result.hit_tiers))
        },
        "save_ms": round(result.timings.store_s * 1000, 3),
    }
    if result.kv_stream is not None:
        r = result.kv_stream
        details["kv_stream"] = {
            "chunks": dict(r.chunks),
            "load_ms": round(r.load_s * 1000, 3),
            "slo_ms": round(r.slo_s * 1000, 3),
            "met": r.met,
            "bytes_read": r.bytes_read,
        }
    if result.blend is not None:
        b = result.blend
        details["blend"] = {
            "method": b.method,
            "recompute_ratio": b.recompute_ratio,
            "source": b.source,
        }
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": details,
    }


@dataclass(frozen=True)
class Rendering:
    """What one request's bodies carry beyond the text: ``n`` choices, per-token ``logprobs``
    (``texts`` renders their tokens), and for completions with ``echo`` the prompt's text (and
    ids, whose logprobs come first when asked)."""

    n: int = 1
    logprobs: bool = False
    echo: str | None = None
    prompt_ids: tuple[int, ...] = ()
    texts: TokenTexts | None = None


class ResponseBuilder:
    """Builds the bodies and chunks of one request (``chat`` selects the chat shapes)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        chat: bool,
        include_usage: bool = False,
        rendering: Rendering = Rendering(),
        tools: ToolCalling | None = None,
    ):
        suffix = request_id.removeprefix("req_")
        self.id = f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}"
        self.model = model
        self.created = created
        self.chat = chat
        self.include_usage = include_usage
        self.r = rendering
        # completions with logprobs: where each choice's next text offset is (streaming)
        self._offsets = [0] * rendering.n
        self.tools = tools if tools is not None and tools.parses else None
        # each choice's call parser (streaming with tools)
        self._calls = [self.tools.parser() for _ in range(rendering.n)] if self.tools else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ------------------------------------------------------------------------

    def body(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            choices = [self._chat_choice(c) for c in result.choices]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage(result)}
        choices = [self._completion_choice(c, result) for c in result.choices]
        return {**self._head("text_completion"), "choices": choices, "usage": usage(result)}

    def _chat_choice(self, c: Choice) -> dict[str, Any]:
        lp = chat_logprobs(self.r.texts, c.logprobs or []) if self.r.logprobs else None
        parsed = self.tools.parse(c.text) if self.tools else Parsed(c.text, ())
        return {
            "index": c.index,
            "message": assistant_message(parsed),
            "finish_reason": finish_reason(c, bool(parsed.calls)),
            "logprobs": lp,
        }

    def _completion_choice(self, c: Choice, result: GenerationResult) -> dict[str, Any]:
        r, lp = self.r, None
        if r.logprobs:
            tokens, entries = list(c.token_ids), list(c.logprobs or [])
            if r.echo is not None:
                tokens = list(r.prompt_ids) + tokens
                entries = list(result.prompt_logprobs or [None] * len(r.prompt_ids)) + entries
            lp = legacy_logprobs(r.texts, entries, tokens, 0)
        return {
            "index": c.index,
            "text": (r.echo or "") + c.text,
            "finish_reason": finish_reason(c),
            "logprobs": lp,
        }

    # -- stream chunks --------------------------------------------------------------------------

    def _chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        role: bool = False,
        logprobs=None,
        **fields,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            delta.update(fields)  # tool_calls, or content null
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason}
            choice["logprobs"] = logprobs
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has the key, only the last one a value
        return out

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role of each choice (and empty content; with
        tools null content, as OpenAI's, since the answer may be only calls); completions with
        ``echo`` (without logprobs: those wait for the prompt's) with the prompt echoed in each
        choice."""
        if self.chat and self.tools is not None:
            return [self._chunk(i, None, None, role=True, content=None) for i in range(self.r.n)]
        if self.chat:
            return [self._chunk(i, "", None, role=True) for i in range(self.r.n)]
        if self.r.echo is not None and not self.r.logprobs:
            return [self._chunk(i, self.r.echo, None) for i in range(self.r.n)]
        return []

    def delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks of one engine ``Delta``: a choice's text (and its token's logprobs), or the
        prompt's logprobs, echoed in every choice."""
        if d.prompt_logprobs is not None:
            if self.chat or self.r.echo is None or not self.r.logprobs:
                return []
            ids = list(self.r.prompt_ids)
            lp = legacy_logprobs(self.r.texts, d.prompt_logprobs, ids, 0)
            self._offsets = [legacy_end(lp, 0)] * self.r.n
            return [self._chunk(i, self.r.echo, None, logprobs=lp) for i in range(self.r.n)]
        lp = None
        if self.r.logprobs and self.chat:
            lp = {"content": chat_content(self.r.texts, d.logprobs), "refusal": None}
        elif self.r.logprobs:
            start = self._offsets[d.index]
            lp = legacy_logprobs(self.r.texts, d.logprobs, [e.token for e in d.logprobs], start)
            self._offsets[d.index] = legacy_end(lp, start)
        if self._calls is None:
            return [self._chunk(d.index, d.text, None, logprobs=lp)]
        chunks = self._event_chunks(d.index, self._calls[d.index].feed(d.text))
        if lp is not None and chunks:
            chunks[0]["choices"][0]["logprobs"] = lp
        elif lp is not None:  # the tokens' text is held by the call parser: their logprobs now
            chunks = [self._chunk(d.index, None, None, logprobs=lp)]
        return chunks

    def _event_chunks(self, index: int, events) -> list[dict[str, Any]]:
        """Choice ``index``'s chunks of what its call parser let through: text, a call's head
        (index, id, type, name, empty arguments), its arguments' pieces (a call's end has no
        chunk of its own)."""
        chunks = []
        for e in events:
            if isinstance(e, Text):
                chunks.append(self._chunk(index, e.text, None))
            elif isinstance(e, CallStart):
                head = {"index": e.index, "id": e.id, "type": "function"}
                head["function"] = {"name": e.name, "arguments": ""}
                chunks.append(self._chunk(index, None, None, tool_calls=[head]))
            elif isinstance(e, CallArgs):
                args = {"index": e.index, "function": {"arguments": e.text}}
                chunks.append(self._chunk(index, None, None, tool_calls=[args]))
        return chunks

    def final_chunks(self, result: GenerationResult) -> list[dict[str, Any]]:
        """A chunk with each choice's finish reason (with tools, after what its call parser held
        back) and, with include_usage, the usage chunk."""
        chunks = []
        for c in result.choices:
            called = False
            if self._calls is not None:
                chunks += self._event_chunks(c.index, self._calls[c.index].finish())
                called = self._calls[c.index].count > 0
            chunks.append(self._chunk(c.index, None if self.chat else "", finish_reason(c, called)))
        if self.include_usage:
            head = self._head("chat.completion.chunk" if self.chat else "text_completion")
            chunks.append({**head, "choices": [], "usage": usage(result)})
        return chunks
