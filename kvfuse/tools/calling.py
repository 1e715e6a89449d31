"""One request's tool calling: what the prompt gets, how decoding is constrained, how the output
is read.

``tool_choice`` decides:

- ``none``: the tools are rendered as for ``auto`` (the same prompt, so the same cached prefix),
  and the output is text, never parsed into calls (a model that writes a call anyway answers
  with that text);
- ``auto``: the output is parsed (``parse``) into text and calls to the request's tools;
- ``required`` / a named function: exactly one call, guaranteed valid. The prompt ends with the
  family's call opening (``ToolFormat.call_prefix``, e.g. ``<tool_call>\\n`` for Qwen2.5 and the
  prompted format, nothing for Llama 3.x), and decoding is constrained by a grammar
  (``kvfuse.structured.json_schema``) to the call object ``{"name": <fn>, "arguments": <its
  parameters schema>}`` (``"parameters"`` for Llama 3.x); for ``required`` with several tools the
  schema is the ``anyOf`` of each tool's, integers without bounds bounded (``bounds``). The
  request ends when the object is complete.

``parallel_tool_calls: false`` keeps only the first call (and, in ``auto``, stops generating at
the first ``</tool_call>``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfuse.generation import Structure

from .bounds import bounded
from .formats import ToolFormat
from .parse import CallParser, Parsed, parse
from .spec import Tool, ToolChoice, ToolsError, new_call_id

Compile = Callable[[dict[str, Any], Any, bool], Structure]


@dataclass(frozen=True)
class ToolCalling:
    """The tools of one request and how its output becomes calls (see the module docstring)."""

    fmt: ToolFormat
    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True
    structure: Structure | None = None  # the forced call's grammar (required / named)
    new_id: Callable[[], str] = new_call_id

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def parses(self) -> bool:
        """The output is read for calls (not with ``tool_choice: none``)."""
        return self.choice.mode != "none"

    @property
    def forced_text(self) -> str:
        """The call opening the prompt ends with (forced calls only)."""
        return self.fmt.call_prefix if self.choice.forced else ""

    @property
    def stops(self) -> tuple[str, ...]:
        """Stop strings to add: the end of the first call when only one is wanted."""
        return ("</tool_call>",) if self.choice.mode == "auto" and not self.parallel else ()

    def parser(self, stream: bool = True) -> CallParser | None:
        """An incremental parser for the output (None when it is not parsed), past the forced
        text; ``stream``: calls as they are generated (``CallParser``), else each once whole."""
        if not self.parses:
            return None
        parser = CallParser(self.names, self.parallel, self.new_id, stream)
        parser.feed(self.forced_text)  # an envelope's opening: nothing to show
        return parser

    def parse(self, text: str) -> Parsed:
        """The whole output ``text`` as content and calls."""
        if not self.parses:
            return Parsed(text, ())
        return parse(self.forced_text + text, self.names, self.parallel, self.new_id)


def call_schema(fmt: ToolFormat, tools: Sequence[Tool], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of the call a forced choice allows: one tool's call object, or for
    ``required`` with several tools the ``anyOf`` of theirs (integers bounded: ``bounds``)."""
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    schemas = [fmt.call_object_schema(t.name, bounded(t.schema)) for t in chosen]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tool_calling(
    fmt: ToolFormat,
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    parallel: bool,
    model: Any,
    compile: Compile | None = None,
) -> ToolCalling:
    """The request's ``ToolCalling``, its grammar compiled for a forced choice, for ``model`` (a
    ``LoadedModel``: its tokenizer and end-of-sequence ids) with ``compile``
    (``kvfuse.structured.json_schema`` unless given). ``strict`` is asked of the grammar (every
    keyword enforced, a schema it cannot enforce refused) when every tool it covers says
    ``strict``; otherwise keywords the grammar cannot enforce are left out of it."""
    if not choice.forced:
        return ToolCalling(fmt, tools, choice, parallel)
    schema = call_schema(fmt, tools, choice)
    strict = all(t.strict for t in tools if choice.mode == "required" or t.name == choice.name)
    try:
        structure = (compile or structured_json_schema)(schema, model, strict)
    except ToolsError:
        raise
    except ValueError as e:  # a parameters schema the grammar compiler does not take
        raise ToolsError(f"tools: a parameters schema cannot be enforced: {e}") from None
    return ToolCalling(fmt, tools, choice, parallel, structure)


def structured_json_schema(schema: dict[str, Any], model: Any, strict: bool) -> Structure:
    """``kvfuse.structured.json_schema``: the grammar of a JSON schema for ``model``."""
    try:
        from kvfuse.structured import json_schema
    except ImportError:
        raise ToolsError(
            'tool_choice: "required" and named functions need constrained decoding '
            '(kvfuse.structured), which this build of kvfuse lacks; use "auto"',
            "tool_choice",
        ) from None
    return json_schema(schema, model, strict)
