"""Messages API response bodies and stream events, built from an engine ``GenerationResult``.

**Usage.** Anthropic splits the prompt's tokens three ways, which add up to the whole prompt::

    cache_read_input_tokens      read from the cache
    cache_creation_input_tokens  written to the cache, up to the last cache breakpoint
    input_tokens                 the rest: after the last breakpoint, and not read

``cache_usage`` maps kvfuse's numbers onto that (pure; table-tested): *read* is the result's
``cached_tokens`` (every reused token: a prefix, a stored conversation, a found passage), and
*written* is the part of the prompt between what was read and the last breakpoint, which this
request hands to the cache (bounded by its ``written_tokens``: nothing when the cache is off).
Tokens up to the last ``1h`` breakpoint are 1-hour writes and the rest 5-minute writes, since a
token is kept as long as the longest breakpoint after it. Where kvfuse differs: it also caches
whole 256-token chunks without any ``cache_control`` and reuses them in later requests; those
reads are reported in ``cache_read_input_tokens`` (they were not prefilled), while those writes
count as ``input_tokens`` (Anthropic writes nothing without a breakpoint), and a prefix of any
length is cached (Anthropic has a minimum of 1024 or more tokens).

**Stream.** Anthropic's event sequence, each as ``event: <type>`` + ``data: <json>``:
``message_start`` (the usage of the prompt, sent once it is prefilled), then for text
``content_block_start``, ``ping``, ``content_block_delta`` (``text_delta``)...,
``content_block_stop``, then ``message_delta`` (stop reason, stop sequence and the final usage,
cumulative) and ``message_stop``. An error after the stream started is an ``error`` event in
Anthropic's shape, and the stream ends.

**Tool use.** With tools (and a ``tool_choice`` other than ``none``) the output is read by
``kvfuse.tools``' call parser: the message's content is its text (when any) and a ``tool_use``
block per call, and ``stop_reason`` is ``"tool_use"`` when it made a call. Streamed, each block
has its own index: text as above, and each call as it is generated, as Anthropic sends one:
``content_block_start`` (a ``tool_use`` block with an empty ``input``) once its name is read,
a ``content_block_delta`` of type ``input_json_delta`` per piece of its input (``partial_json``;
the pieces join into the input's JSON), and ``content_block_stop``. A call that breaks off after
it started (invalid JSON, or cut by ``max_tokens``) stops with the pieces sent (a JSON prefix,
which the SDK's partial parser reads); ``stop_reason`` is then ``tool_use`` (``max_tokens`` when
cut).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfuse.engine import Breakpoint, GenerationResult
from kvfuse.tools import CallArgs, CallParser, CallStart, Parsed, Text, ToolCalling

from . import anthropic_errors
from .anthropic_tools import content_blocks, tool_use_block

ONE_HOUR = 3600.0


@dataclass(frozen=True)
class CacheUsage:
    """A prompt's tokens as Anthropic counts them (they add up to the prompt's length)."""

    input_tokens: int
    creation_5m: int
    creation_1h: int
    read: int

    @property
    def creation(self) -> int:
        return self.creation_5m + self.creation_1h


def cache_usage(
    prompt_tokens: int, cached: int, written: int, breakpoints: tuple[Breakpoint, ...]
) -> CacheUsage:
    """How ``prompt_tokens`` split into read, written (5m / 1h) and other input tokens, for a
    request that reused ``cached`` tokens, handed ``written`` prompt tokens to the cache and
    set ``breakpoints``."""
    read = max(0, min(cached, prompt_tokens))
    last = min(max((b.position for b in breakpoints), default=0), prompt_tokens)
    last_1h = min(
        max((b.position for b in breakpoints if (b.ttl_s or 0) >= ONE_HOUR), default=0), last
    )
    budget = max(0, written)
    creation_1h = min(max(0, last_1h - read), budget)
    creation_5m = min(max(0, last - max(read, last_1h)), budget - creation_1h)
    rest = prompt_tokens - read - creation_1h - creation_5m
    return CacheUsage(rest, creation_5m, creation_1h, read)


def usage(
    result: GenerationResult, breakpoints: tuple[Breakpoint, ...], output_tokens: int
) -> dict[str, Any]:
    """The ``usage`` object of a response (or of ``message_start`` / ``message_delta``)."""
    u = cache_usage(result.prompt_tokens, result.cached_tokens, result.written_tokens, breakpoints)
    return {
        "input_tokens": u.input_tokens,
        "cache_creation_input_tokens": u.creation,
        "cache_read_input_tokens": u.read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.creation_5m,
            "ephemeral_1h_input_tokens": u.creation_1h,
        },
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def stop_reason(
    result: GenerationResult,
    max_tokens: int,
    called: bool = False,
    stop_sequences: tuple[str, ...] | None = None,
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished result; ``max_tokens``: what
    the request asked for (the engine's own limit can be lower: the context window's room);
    ``called``: the output made a tool call (``tool_use``, unless the output was cut at
    ``max_tokens``, as Anthropic reports it); ``stop_sequences``: the request's (a stop string
    the tools added, the end of a single call, is no stop sequence; None: any)."""
    if called and result.finish_reason != "length":
        return "tool_use", None
    if result.finish_reason == "length":
        if result.completion_tokens >= max_tokens:
            return "max_tokens", None
        return "model_context_window_exceeded", None
    seq = result.stop_sequence
    if seq is not None and (stop_sequences is None or seq in stop_sequences):
        return "stop_sequence", seq
    return "end_turn", None


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: its type, then its JSON."""
    return (
        f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
    )


class MessageBuilder:
    """The body (or the stream events) of one Messages response; ``tools``: the request's (its
    output is parsed into calls), ``stop_sequences``: the request's own."""

    def __init__(
        self,
        message_id: str,
        model: str,
        max_tokens: int,
        breakpoints=(),
        tools: ToolCalling | None = None,
        stop_sequences: tuple[str, ...] | None = None,
    ):
        self.id, self.model, self.max_tokens = message_id, model, max_tokens
        self.breakpoints = tuple(breakpoints)
        self.tools = tools if tools is not None and tools.parses else None
        self.stop_sequences = stop_sequences
        self.parser: CallParser | None = self.tools.parser() if self.tools else None
        self.started = False  # message_start sent
        self.index = 0  # the index of the next content block
        self.block_open = False  # a text block started and not stopped
        self.pinged = False

    def _message(self, content: list, reason, sequence, usage_: dict) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage_,
        }

    def _reason(self, result: GenerationResult, called: bool) -> tuple[str, str | None]:
        return stop_reason(result, self.max_tokens, called, self.stop_sequences)

    def body(self, result: GenerationResult) -> dict[str, Any]:
        """The whole message. ``max_tokens`` 0 (pre-warming) returns no content and counts no
        output token: the one the engine generated is not returned."""
        prewarm = self.max_tokens == 0
        text = "" if prewarm else result.text
        parsed = self.tools.parse(text) if self.tools and text else Parsed(text, ())
        reason, sequence = self._reason(result, bool(parsed.calls))
        output = 0 if prewarm else result.completion_tokens
        content = content_blocks(parsed)
        return self._message(content, reason, sequence, usage(result, self.breakpoints, output))

    # -- stream events --------------------------------------------------------------------------

    def start(self, prefilled: GenerationResult) -> list[str]:
        """``message_start``, with the usage of the prompt as prefilled (no output yet)."""
        self.started = True
        message = self._message([], None, None, usage(prefilled, self.breakpoints, 0))
        return [sse("message_start", {"type": "message_start", "message": message})]

    def text(self, piece: str) -> list[str]:
        """The events of a piece of output: text deltas, or with tools what the call parser lets
        through (text, calls as they are generated)."""
        if self.parser is None:
            return self._text(piece)
        return self._events(self.parser.feed(piece))

    def _events(self, events) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, Text):
                out += self._text(e.text)
            elif isinstance(e, CallStart):
                out += self._close() + self._open(tool_use_block(e.id, e.name, "", streamed=True))
            elif isinstance(e, CallArgs):
                out.append(self._input_delta(e.text))
            else:  # the call's end: its block stops
                out.append(self._stop())
        return out

    def _input_delta(self, piece: str) -> str:
        """A piece of the open ``tool_use`` block's input JSON."""
        delta = {"type": "input_json_delta", "partial_json": piece}
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse("content_block_delta", event)

    def _stop(self) -> str:
        """``content_block_stop`` of the current block; the next block gets the next index."""
        self.index += 1
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})

    def _open(self, block: dict[str, Any]) -> list[str]:
        """``content_block_start`` of the next block (the first one followed by a ``ping``)."""
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out = [sse("content_block_start", start)]
        if not self.pinged:
            self.pinged = True
            out.append(sse("ping", {"type": "ping"}))
        return out

    def _close(self) -> list[str]:
        """``content_block_stop`` of the open text block (if any)."""
        if not self.block_open:
            return []
        self.block_open = False
        return [self._stop()]

    def _text(self, piece: str) -> list[str]:
        """A text delta; the first one of a text block opens it."""
        out = []
        if not self.block_open:
            out += self._open({"type": "text", "text": ""})
            self.block_open = True
        delta = {"type": "text_delta", "text": piece}
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return out + [sse("content_block_delta", event)]

    def finish(self, result: GenerationResult) -> list[str]:
        """The events after the last text: what the call parser held back, the open block's stop,
        ``message_delta`` (the stop reason and the cumulative usage), ``message_stop``."""
        out = [] if self.started else self.start(result)
        if self.parser is not None:
            out += self._events(self.parser.finish())
        out += self._close()
        if not self.pinged:
            out.append(sse("ping", {"type": "ping"}))
        reason, sequence = self._reason(result, bool(self.parser and self.parser.count))
        final = usage(result, self.breakpoints, result.completion_tokens)
        for key in ("cache_creation", "service_tier"):  # not in Anthropic's message_delta usage
            del final[key]
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": final,
        }
        out.append(sse("message_delta", delta))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def error(status: int, message: str, request_id: str | None = None) -> str:
        """An ``error`` event (after the stream started), in Anthropic's shape."""
        return sse("error", anthropic_errors.error_body(status, message, request_id))
