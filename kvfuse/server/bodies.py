"""Response bodies and server-sent-event chunks, built from an engine ``GenerationResult``.

Streaming follows what the official OpenAI clients parse: one ``data: {json}\\n\\n`` event per chunk
(``text_completion`` or ``chat.completion.chunk`` objects), a chunk carrying ``finish_reason``,
with ``stream_options.include_usage`` a last chunk whose ``choices`` is empty and ``usage`` set,
then ``data: [DONE]\\n\\n``. An error after the stream started is sent as ``data: {"error": ...}``
(the clients raise it) and the stream ends without [DONE].
"""

from __future__ import annotations

import json
from typing import Any

from kvfuse.engine import GenerationResult

SSE_DONE = "data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish reason (the caller handles "cancelled" as an error before getting here)."""
    return "length" if result.finish_reason == "length" else "stop"


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
        self, request_id: str, model: str, created: int, chat: bool, include_usage: bool = False
    ):
        suffix = request_id.removeprefix("req_")
        self.id = f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}"
        self.model = model
        self.created = created
        self.chat = chat
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ------------------------------------------------------------------------

    def body(self, result: GenerationResult) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish_reason(result),
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

    def _chunk(self, text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has the key, only the last one a value
        return out

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (and empty content); completions have none."""
        return self._chunk("", None, role=True) if self.chat else None

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk(text, None)

    def final_chunks(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The chunk with the finish reason and, with include_usage, the usage chunk."""
        chunks = [self._chunk(None if self.chat else "", finish_reason(result))]
        if self.include_usage:
            head = self._head("chat.completion.chunk" if self.chat else "text_completion")
            chunks.append({**head, "choices": [], "usage": usage(result)})
        return chunks
