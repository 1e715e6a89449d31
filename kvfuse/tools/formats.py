"""How one model family writes tool calls: which format its chat template speaks, and the exact
text a forced call (``tool_choice: required`` or a named function) is made of.

Three formats:

- ``hermes`` (Qwen2.5, Qwen3 and other templates that mention ``<tool_call>``): the template
  renders the tools (its ``tools`` argument), assistant ``tool_calls`` and ``tool`` messages
  itself; a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 templates: they mention ``<|python_tag|>`` or the
  ``"parameters"`` format): the template renders everything; a call is the JSON object
  ``{"name": ..., "parameters": {...}}``.
- ``prompted`` (every template that takes no ``tools``: SmolLM2, Gemma 3, and tool-aware templates
  of a format kvfuse does not know): kvfuse writes the tools into the system message itself
  (``render.tools_section``); a call is written as in ``hermes``.

Parsing (``parse``) accepts every format's envelope whatever the family, since small models drift
between them; the family decides how the prompt is rendered and what a forced call looks like.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jinja2 import Environment, TemplateSyntaxError, meta
from jinja2.ext import loopcontrols


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format (see the module docstring)."""

    name: str
    native: bool  # the chat template renders tools, calls and results itself
    arguments_key: str  # the key of a call's arguments in its JSON object
    call_prefix: str  # the text before a forced call's JSON object (put in the prompt)

    def call_object_schema(self, name: str, parameters: dict) -> dict:
        """The JSON schema of one call's object to ``name``: its name fixed, its arguments
        ``parameters``, nothing else, in this order (the name first)."""
        return {
            "type": "object",
            "properties": {"name": {"const": name}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }


HERMES = ToolFormat("hermes", True, "arguments", "<tool_call>\n")
LLAMA3 = ToolFormat("llama3", True, "parameters", "")
PROMPTED = ToolFormat("prompted", False, "arguments", "<tool_call>\n")


@functools.lru_cache(maxsize=16)
def detect(template: str | None) -> ToolFormat:
    """The format of a chat template: native when the template reads a ``tools`` variable and
    writes calls in a format known here, else ``prompted``."""
    if not template or "tools" not in _variables(template):
        return PROMPTED
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3
    return PROMPTED


def _variables(template: str) -> set[str]:
    """The variables a template reads from its caller (jinja's own analysis, not a text search:
    a template that merely says "tools" in its text does not take them)."""
    env = Environment(extensions=[loopcontrols])
    try:
        return meta.find_undeclared_variables(env.parse(template))
    except TemplateSyntaxError:
        return set()
