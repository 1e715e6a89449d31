"""Tools (function calling), OpenAI style: definitions and results into the prompt, calls out of
the model's text.

- ``spec``: the checked request data (``Tool``, ``ToolChoice``, ``ToolCall``, ``ToolsError``);
- ``formats``: each chat template's tool format (``detect``: hermes, llama3 or prompted);
- ``render``: messages with calls and results, and the tools, as the template gets them;
- ``parse``: model output -> text and calls, streaming (``CallParser``) or whole (``parse``);
- ``args``: a call object's JSON read as it comes (its arguments streamed in normal form);
- ``calling``: one request's ``ToolCalling``: ``tool_choice`` and ``parallel_tool_calls``, the
  grammar that guarantees a forced call.

The server (``kvfuse.server.translate``, ``bodies``, ``responses_api``) maps OpenAI's fields to
these; everything here is pure and knows no HTTP.
"""

from .calling import ToolCalling, call_schema, tool_calling
from .formats import HERMES, LLAMA3, PROMPTED, ToolFormat, detect
from .parse import Call, CallArgs, CallParser, CallStart, Event, Parsed, Text, parse
from .render import Rendered, render, tools_section, uses_tools
from .spec import (
    Tool,
    ToolCall,
    ToolChoice,
    ToolsError,
    choice_from_openai,
    named_choice,
    new_call_id,
    tools_from_openai,
)

__all__ = [
    "HERMES",
    "LLAMA3",
    "PROMPTED",
    "Call",
    "CallArgs",
    "CallParser",
    "CallStart",
    "Event",
    "Parsed",
    "Rendered",
    "Text",
    "Tool",
    "ToolCall",
    "ToolCalling",
    "ToolChoice",
    "ToolFormat",
    "ToolsError",
    "call_schema",
    "choice_from_openai",
    "detect",
    "named_choice",
    "new_call_id",
    "parse",
    "render",
    "tool_calling",
    "tools_from_openai",
    "tools_section",
    "uses_tools",
]
