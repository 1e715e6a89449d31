"""Chat messages with tools, calls and results -> the messages (and ``tools``) a chat template gets.

The server's messages are OpenAI's: an assistant message may carry ``tool_calls`` (arguments as a
JSON string), a ``tool`` message answers one by ``tool_call_id``. For a template that supports
tools (``ToolFormat.native``) they are passed on as Hugging Face templates expect them: ``tools``
as the template argument, ``tool_calls`` with their arguments as objects, ``tool`` messages as
they are. For any other template kvfuse renders them as text (the *prompted* format):

- the tools: a section appended to the system message (a system message is added when there is
  none), ``tools_section``: the definitions as JSON within ``<tools></tools>`` and how to call;
- an assistant's calls: after its text, one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`` per call, on lines of their own;
- results: a user message of ``<tool_response>\\n...\\n</tool_response>`` blocks, one per ``tool``
  message in a row (a user message right after them joins that turn, after a blank line), so that
  templates that want user and assistant turns to alternate (Gemma 3) accept the conversation.

``Rendered.where`` maps each message to where its content now starts, so that cache breakpoints
set on the messages still find their place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .formats import ToolFormat
from .spec import Tool, ToolsError

_CALL_TEXT = "<tool_call>\n{}\n</tool_call>"
_RESULT_OPEN, _RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"


@dataclass(frozen=True)
class Rendered:
    """The template's ``messages`` and ``tools`` argument (None: not passed), and for each input
    message ``(index in messages, offset of its content there)``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    where: tuple[tuple[int, int], ...]

    @classmethod
    def plain(cls, messages: list[dict[str, Any]]) -> Rendered:
        """Messages without tools, calls or results: as they are."""
        return cls(messages, None, tuple((i, 0) for i in range(len(messages))))

    def mark(self, message: int, offset: int) -> tuple[int, int]:
        """Where a point ``offset`` characters into input message ``message``'s content is now."""
        index, start = self.where[message]
        return index, start + offset


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    """Some message carries calls or is a result."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def render(messages: list[dict[str, Any]], fmt: ToolFormat, tools: Sequence[Tool]) -> Rendered:
    """``messages`` (and ``tools``) for a template of format ``fmt`` (see the module docstring)."""
    check_results(messages)
    if fmt.native:
        out = [_native(m) for m in messages]
        defs = [t.openai() for t in tools] or None
        return Rendered(out, defs, tuple((i, 0) for i in range(len(messages))))
    return _prompted(messages, tools)


def _native(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return dict(m)
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def _prompted(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> Rendered:
    out: list[dict[str, Any]] = []
    where: list[tuple[int, int]] = []
    results: set[int] = set()  # indices in ``out`` of the user messages made of results
    section = tools_section(tools) if tools else None
    if section is not None and (not messages or messages[0]["role"] != "system"):
        out.append({"role": "system", "content": section})
        section = None
    for i, m in enumerate(messages):
        last = len(out) - 1
        if m["role"] == "tool":
            block = _RESULT_OPEN + m.get("content", "") + _RESULT_CLOSE
            if last in results:
                _append(out, last, "\n", block, len(_RESULT_OPEN), where)
            else:
                results.add(len(out))
                out.append({"role": "user", "content": block})
                where.append((len(out) - 1, len(_RESULT_OPEN)))
        elif m["role"] == "user" and last in results:
            _append(out, last, "\n\n", m.get("content", ""), 0, where)
        else:
            where.append((len(out), 0))
            out.append(_prompted_message(m, section if i == 0 else None))
    return Rendered(out, None, tuple(where))


def _append(
    out: list[dict[str, Any]],
    index: int,
    sep: str,
    text: str,
    offset: int,
    where: list[tuple[int, int]],
) -> None:
    """Join ``text`` to ``out[index]``'s content after ``sep``; the input message's content
    starts ``offset`` characters into ``text``."""
    start = len(out[index]["content"]) + len(sep)
    out[index]["content"] += sep + text
    where.append((index, start + offset))


def _prompted_message(m: dict[str, Any], section: str | None) -> dict[str, Any]:
    """One message in the prompted format: the system message with the tools section after its
    text, an assistant message with its calls written out."""
    out = dict(m)
    out.pop("tool_calls", None)
    if section is not None:
        out["content"] = (m.get("content") or "") + "\n\n" + section
    if m.get("tool_calls"):
        calls = "\n".join(
            call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
        )
        out["content"] = (m["content"] + "\n" if m.get("content") else "") + calls
    return out


def call_text(name: str, arguments: str) -> str:
    """A call as the prompted format writes it (and as a model is asked to)."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return _CALL_TEXT.format(body)


def tools_section(tools: Sequence[Tool]) -> str:
    """The prompted format's system-message section: the definitions and how to call them."""
    defs = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{defs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "The results come back within <tool_response></tool_response> XML tags. When no function "
        "is needed, answer directly."
    )


def _arguments(text: str) -> Any:
    """A call's arguments as templates want them: the JSON object, or the text when it is none."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def check_results(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message must answer a call of an earlier assistant message (as OpenAI
    requires), by its ``tool_call_id``."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            calls.add(c["id"])
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            raise ToolsError(
                f"messages[{i}]: a message with role 'tool' must answer a preceding assistant "
                f"message's tool_calls; no call has id {m.get('tool_call_id')!r}",
                "messages",
            )
