"""What a request says about tools: the definitions, the choice, and the calls a model made.

Pure, checked data: ``tools_from_openai`` and ``choice_from_openai`` read the chat completions
shapes (``{"type": "function", "function": {...}}``; ``"auto"`` or
``{"type": "function", "function": {"name": ...}}``) and raise ``ToolsError`` (a ValueError naming
the request field) for anything OpenAI would refuse, so that the server answers a 400 before the
request is queued.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

MAX_TOOLS = 128  # OpenAI's limit per request
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

Mode = Literal["none", "auto", "required", "function"]


class ToolsError(ValueError):
    """A request's tools are malformed; ``param`` is the request field to name in the 400."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' schema (an object with no properties when the tool declares none)."""
        return self.parameters if self.parameters is not None else _NO_ARGUMENTS

    def openai(self) -> dict[str, Any]:
        """The chat completions definition, as chat templates (and the prompted format) show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """``none``: never call; ``auto``: the model decides; ``required``: exactly one call to any tool;
    ``function``: exactly one call to ``name``."""

    mode: Mode = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The output is constrained to a call (``required`` or a named function)."""
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is a JSON object's text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """A fresh call id in OpenAI's style (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def tools_from_openai(tools: Sequence[dict[str, Any]]) -> tuple[Tool, ...]:
    """The chat completions ``tools`` as ``Tool``s: function tools only, named as OpenAI allows,
    each name once, ``parameters`` an object schema."""
    if not tools:
        raise ToolsError("tools: give at least one tool, or leave tools out")
    if len(tools) > MAX_TOOLS:
        raise ToolsError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ToolsError(f'{where}.type: only "function" tools are supported, got {kind!r}')
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolsError(f"{where}.function: must be an object with a name")
        out.append(_tool(f, f"{where}.function"))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ToolsError(f"tools: the function name {dup!r} is defined more than once")
    return tuple(out)


def _tool(f: dict[str, Any], where: str) -> Tool:
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolsError(
            f"{where}.name: must be 1 to 64 letters, digits, underscores or dashes, got {name!r}"
        )
    description = f.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError(f"{where}.description: must be a string")
    params = f.get("parameters")
    if params is not None and (
        not isinstance(params, dict) or params.get("type", "object") != "object"
    ):
        raise ToolsError(f'{where}.parameters: must be a JSON schema of "type": "object"')
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolsError(f"{where}.strict: must be a boolean")
    return Tool(name, description, params, bool(strict))


def choice_from_openai(value: str | dict[str, Any] | None, tools: Sequence[Tool]) -> ToolChoice:
    """The chat completions ``tool_choice`` (default ``auto``); a named function must be one of
    ``tools``."""
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolsError(
                f'tool_choice: must be "none", "auto", "required" or '
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}',
                "tool_choice",
            )
        return ToolChoice(value)  # type: ignore[arg-type]
    f = value.get("function") if value.get("type") == "function" else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise ToolsError(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return named_choice(name, tools)


def named_choice(name: str, tools: Sequence[Tool]) -> ToolChoice:
    """The choice of function ``name``, which must be one of ``tools``."""
    if name not in {t.name for t in tools}:
        raise ToolsError(
            f"tool_choice: the function {name!r} is not one of the tools "
            f"({', '.join(t.name for t in tools)})",
            "tool_choice",
        )
    return ToolChoice("function", name)
