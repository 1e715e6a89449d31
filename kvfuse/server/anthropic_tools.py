"""Anthropic's tool use <-> ``kvfuse.tools`` (which speaks OpenAI's shapes). Pure; table-tested in
``tests/unit/test_anthropic_tools.py``.

- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``, ``strict``) become
  ``Tool``s, checked as Anthropic checks them (names ``^[a-zA-Z0-9_-]{1,64}$``, each once,
  ``input_schema`` of ``"type": "object"``);
- ``tool_choice``: ``auto`` -> auto, ``any`` -> required, ``tool`` -> the named function,
  ``none`` -> none; ``disable_parallel_tool_use: true`` -> one call at most (parallel false);
  ``auto`` is the default with tools;
- history: an assistant's ``tool_use`` block is a call of its chat message (``arguments``: its
  ``input`` as JSON text), a user's ``tool_result`` block a ``tool`` chat message answering it
  (its text, after ``"Error: "`` when ``is_error``);
- output: the parsed calls are ``tool_use`` content blocks with ids ``toolu_...`` and their
  arguments as the ``input`` object.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from kvfuse.tools import Parsed, Tool, ToolChoice, ToolsError, named_choice

from .anthropic_schemas import ToolChoiceParam, ToolDefinition, ToolResultBlock, ToolUseBlock

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ID_CHARS = string.ascii_letters + string.digits
ERROR_PREFIX = "Error: "
# Anthropic's answer to calls or results in a request without tools.
NEEDS_TOOLS = "Requests which include `tool_use` or `tool_result` blocks must define tools."


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, choice and whether several calls may be made (None: no tools)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True


def new_tool_use_id() -> str:
    """A fresh call id in Anthropic's style: ``toolu_`` and 24 letters or digits."""
    return "toolu_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def tools_from_anthropic(defs: list[ToolDefinition]) -> tuple[Tool, ...]:
    """Custom tool definitions as ``Tool``s (``ToolsError`` naming ``tools[i]``)."""
    out: list[Tool] = []
    for i, d in enumerate(defs):
        if not _NAME.match(d.name):
            raise ToolsError(
                f"tools[{i}].name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$', "
                f"got {d.name!r}"
            )
        if d.input_schema.get("type") != "object":
            raise ToolsError(f'tools[{i}].input_schema.type: must be "object"')
        out.append(Tool(d.name, d.description, d.input_schema, bool(d.strict)))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ToolsError(f"tools: Tool names must be unique (got {dup!r} more than once)")
    return tuple(out)


_MODES = {"auto": "auto", "any": "required", "none": "none"}


def choice_from_anthropic(
    choice: ToolChoiceParam | None, tools: tuple[Tool, ...]
) -> tuple[ToolChoice, bool]:
    """``(choice, parallel)`` of Anthropic's ``tool_choice`` (default ``auto``, parallel)."""
    if choice is None:
        return ToolChoice("auto"), True
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    if choice.type == "tool":
        return named_choice(choice.name, tools), parallel
    return ToolChoice(_MODES[choice.type]), parallel  # type: ignore[arg-type]


def tool_use(
    defs: list[ToolDefinition] | None, choice: ToolChoiceParam | None, in_history: bool
) -> ToolUse | None:
    """The request's ``ToolUse`` (None without tools); ``in_history``: some message has a
    ``tool_use`` or ``tool_result`` block, which needs tools (as Anthropic requires)."""
    if not defs:
        if choice is not None:
            raise ToolsError("tool_choice: only allowed when tools are specified", "tool_choice")
        if in_history:
            raise ToolsError(NEEDS_TOOLS, "tools")
        return None
    tools = tools_from_anthropic(defs)
    mode, parallel = choice_from_anthropic(choice, tools)
    return ToolUse(tools, mode, parallel)


def call_of(block: ToolUseBlock) -> dict[str, Any]:
    """An assistant's ``tool_use`` block as a chat message's tool call (OpenAI's shape)."""
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


def result_text(block: ToolResultBlock) -> str:
    """A ``tool_result``'s content as the ``tool`` chat message's text."""
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "\n".join(b.text for b in content)
    return ERROR_PREFIX + text if block.is_error else text


def content_blocks(parsed: Parsed) -> list[dict[str, Any]]:
    """A response's content: its text (when any), then a ``tool_use`` block per call."""
    out: list[dict[str, Any]] = []
    if parsed.content:
        out.append({"type": "text", "text": parsed.content})
    out += [tool_use_block(c.id, c.name, c.arguments) for c in parsed.calls]
    return out


def tool_use_block(call_id: str, name: str, arguments: str, streamed: bool = False) -> dict:
    """A ``tool_use`` content block; ``streamed``: as ``content_block_start`` opens it (an empty
    ``input``, which the ``input_json_delta`` events then fill)."""
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": {} if streamed else json.loads(arguments),
    }
