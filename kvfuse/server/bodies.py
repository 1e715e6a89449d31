"""Response bodies and server-sent-event chunks, built from an engine ``GenerationResult``.

Streaming follows what the official OpenAI clients parse: one ``data: {json}\\n\\n`` event per chunk
(``text_completion`` or ``chat.completion.chunk`` objects), a chunk carrying ``finish_reason``,
with ``stream_options.include_usage`` a last chunk whose ``choices`` is empty and ``usage`` set,
then ``data: [DONE]\\n\\n``. An error after the stream started is sent as ``data: {"error": ...}``
(the clients raise it) and the stream ends without [DONE].

With tools (``kvfuse.tools``), the output is parsed: the message gets ``tool_calls`` (and
``content`` null when it was only calls), the finish reason is ``tool_calls``; a stream sends the
text before a call as ``content`` deltas and each call, once complete, as OpenAI does: a delta
``tool_calls[0] = {index, id, type: "function", function: {name, arguments: ""}}``, then one with
``function.arguments``.
"""

from __future__ import annotations

import json
from typing import Any

from kvfuse.engine import GenerationResult
from kvfuse.tools import Call, Parsed, ToolCalling

SSE_DONE = "data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(result: GenerationResult, called: bool = False) -> str:
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


class ResponseBuilder:
    """Builds the bodies and chunks of one request (``chat`` selects the chat shapes)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        chat: bool,
        include_usage: bool = False,
        tools: ToolCalling | None = None,
    ):
        suffix = request_id.removeprefix("req_")
        self.id = f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}"
        self.model = model
        self.created = created
        self.chat = chat
        self.include_usage = include_usage
        self.tools = tools if tools is not None and tools.parses else None
        self._calls = self.tools.parser() if self.tools is not None else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ------------------------------------------------------------------------

    def body(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            parsed = self.tools.parse(result.text) if self.tools else Parsed(result.text, ())
            choice = {
                "index": 0,
                "message": assistant_message(parsed),
                "finish_reason": finish_reason(result, bool(parsed.calls)),
                "logprobs": None,
            }
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(result)}
        choice = {
            "index": 0,
            "text": result.text,
            "finish_reason": finish_reason(result),
            "logprobs": None,
        }
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(result)}

    # -- stream chunks --------------------------------------------------------------------------

    def _chunk(
        self, text: str | None, reason: str | None, role: bool = False, **fields
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            delta.update(fields)  # tool_calls
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has the key, only the last one a value
        return out

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (and empty content; with tools null content,
        as OpenAI's, since the answer may be only calls); completions have none."""
        if not self.chat:
            return None
        if self.tools is not None:
            return self._chunk(None, None, role=True, content=None)
        return self._chunk("", None, role=True)

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(text, None)

    def stream_chunks(self, text: str) -> list[dict[str, Any]]:
        """The chunks of a generated text piece: itself, or with tools what the call parser lets
        through (text, complete calls)."""
        if self._calls is None:
            return [self.text_chunk(text)]
        return self._event_chunks(self._calls.feed(text))

    def _event_chunks(self, events) -> list[dict[str, Any]]:
        chunks = []
        for e in events:
            if not isinstance(e, Call):
                chunks.append(self.text_chunk(e.text))
                continue
            c = e.call
            head = {"index": e.index, "id": c.id, "type": "function"}
            head["function"] = {"name": c.name, "arguments": ""}
            args = {"index": e.index, "function": {"arguments": c.arguments}}
            chunks.append(self._chunk(None, None, tool_calls=[head]))
            chunks.append(self._chunk(None, None, tool_calls=[args]))
        return chunks

    def final_chunks(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The chunk with the finish reason and, with include_usage, the usage chunk (with tools,
        first what the call parser held back)."""
        chunks = self._event_chunks(self._calls.finish()) if self._calls is not None else []
        called = self._calls is not None and bool(self._calls.calls)
        chunks.append(self._chunk(None if self.chat else "", finish_reason(result, called)))
        if self.include_usage:
            head = self._head("chat.completion.chunk" if self.chat else "text_completion")
            chunks.append({**head, "choices": [], "usage": usage(result)})
        return chunks
