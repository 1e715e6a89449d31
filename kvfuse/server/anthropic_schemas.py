"""Request and response bodies of Anthropic's Messages API (pydantic models; the OpenAPI schema).

Validated as Anthropic validates them: strictly typed, and an unknown field is a 400 naming it
(Anthropic answers "Extra inputs are not permitted"), never ignored. Fields Anthropic documents
that kvfuse does not implement (``thinking``, server tools, ...) are declared here so that the
schema lists them, and refused with a 400 naming them by ``anthropic_translate.refuse_unsupported``.
Message content blocks are kept as objects here and parsed by ``anthropic_translate`` (into
``TextBlock``, ``ToolUseBlock``, ``ToolResultBlock``), which names the block
(``messages[0].content[1]``) and its type (``image``, ``document``, ...) in its 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its definitions inlined (for a field's published schema)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


def _refused(description: str, *allowed: dict[str, Any]) -> Any:
    """A field of Anthropic's API that kvfuse refuses unless null (or one of ``allowed``): typed
    ``Any`` so that ``anthropic_translate`` names it in its 400, published as what is accepted."""
    accepted = [{"type": "null"}, *allowed]
    return Field(None, description=description, json_schema_extra={"anyOf": accepted})


# ------------------------------------------------------------------------------------ requests


class CacheControlEphemeral(_Strict):
    """A cache breakpoint: the prompt up to the end of the block it is on is stored and found by
    the next request with the same prefix."""

    type: Literal["ephemeral"] = Field(..., description='Only "ephemeral", as Anthropic.')
    ttl: Literal["5m", "1h"] = Field(
        "5m",
        description="How long the prefix stays at least, refreshed each time it is read (kvfuse "
        "keeps it at least this long, possibly longer: the tiers' own policy).",
    )


class TextBlock(_Strict):
    """A text content block (of ``system`` or of a message)."""

    type: Literal["text"]
    text: str = Field(..., min_length=1, description="Non-empty, as Anthropic requires.")
    cache_control: CacheControlEphemeral | None = Field(
        None, description="A cache breakpoint at the end of this block."
    )
    citations: Any = _refused("Not supported: must be absent or null.")


_ID = r"^[a-zA-Z0-9_-]+$"


class ToolUseBlock(_Strict):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(..., pattern=_ID, description="The call's id, answered by a tool_result.")
    name: str = Field(..., min_length=1, max_length=200, description="The tool called.")
    input: dict[str, Any] = Field(..., description="The call's arguments (an object).")
    cache_control: CacheControlEphemeral | None = Field(
        None,
        description="A cache breakpoint; kvfuse sets it at the end of the message's text before "
        "its calls.",
    )


class ToolResultBlock(_Strict):
    """The result of a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., pattern=_ID, description="The id of the call it answers.")
    content: str | list[TextBlock] | None = Field(
        None, description="The result: a string or text blocks (other block types: a 400)."
    )
    is_error: bool | None = Field(
        None, description='The call failed: the model sees the content after "Error: ".'
    )
    cache_control: CacheControlEphemeral | None = Field(
        None, description="A cache breakpoint at the end of the result."
    )


class ToolDefinition(_Strict):
    """A custom tool (client tool): the model may call it with an input matching its schema."""

    type: Literal["custom"] | None = Field(
        None, description='Only custom tools ("custom" or absent); server tools are refused.'
    )
    name: str = Field(..., description="^[a-zA-Z0-9_-]{1,64}$, unique within the request.")
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        ..., description='The input\'s JSON schema, of "type": "object".'
    )
    cache_control: CacheControlEphemeral | None = Field(
        None,
        description="A cache breakpoint after the tools (kvfuse renders them in the system turn: "
        "the breakpoint is at the end of the system turn).",
    )
    strict: bool | None = Field(
        None,
        description="With a forced call (tool_choice any / tool), every keyword of the schema is "
        "enforced, and a schema the grammar cannot enforce is a 400.",
    )


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call.")


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = Field(
        None, description="Accepted: a forced call is always exactly one call here."
    )


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str = Field(..., description="The tool that must be called (one of tools).")
    disable_parallel_tool_use: bool | None = Field(
        None, description="Accepted: a forced call is always exactly one call here."
    )


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class InputMessage(_Strict):
    role: Literal["user", "assistant", "system"]
    # Blocks are parsed by anthropic_translate (its 400s name the block and its type); the
    # published schema says what is accepted: a non-empty string or non-empty text blocks.
    content: str | list[dict[str, Any]] = Field(
        ...,
        description="A string, or a list of content blocks: text, tool_use (assistant "
        "messages) and tool_result (user messages) blocks are supported; any other type (image, "
        "document, ...) is a 400 naming it.",
        json_schema_extra={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "anyOf": [
                            _inlined(TextBlock),
                            _inlined(ToolUseBlock),
                            _inlined(ToolResultBlock),
                        ]
                    },
                },
            ]
        },
    )


class MessageMetadata(_Strict):
    user_id: str | None = Field(
        None, max_length=256, description="An opaque end-user id (accepted, not stored)."
    )


class MessagesInput(_Strict):
    """The prompt of a Messages request (shared by /v1/messages and its count_tokens)."""

    model: str = Field(
        ...,
        description="The served model's name, as listed by GET /v1/models.",
        examples=["smollm2"],
    )
    messages: list[InputMessage] = Field(
        ...,
        description="The conversation; consecutive turns of the same role are combined into "
        "one, as Anthropic does. The last message must be a user message: kvfuse does not "
        "continue a partial assistant message (prefill).",
    )
    system: str | list[TextBlock] | None = Field(
        None, description="The system prompt: a string or a list of text blocks."
    )
    cache_control: CacheControlEphemeral | None = Field(
        None,
        description="Automatic caching: a cache breakpoint at the end of the last block of the "
        "last message.",
    )
    tools: list[ToolDefinition] | None = Field(
        None,
        max_length=128,
        description="Custom tools the model may call (rendered by the chat template's tools "
        "argument, or kvfuse's prompted format); server tools are refused.",
    )
    tool_choice: ToolChoiceParam | None = Field(
        None,
        description="auto (the default with tools), any (one call to any tool), tool (one call "
        "to the named tool) or none; disable_parallel_tool_use: at most one call. A forced call "
        "(any / tool) is constrained by a grammar: its input always matches input_schema.",
    )
    # Anthropic's fields kvfuse refuses (a 400 naming the field when present and not null).
    thinking: Any = _refused(
        'Only {"type": "disabled"}; extended thinking is refused with a 400.',
        {
            "type": "object",
            "properties": {"type": {"const": "disabled"}},
            "required": ["type"],
            "additionalProperties": False,
        },
    )
    mcp_servers: Any = _refused(
        "Not supported: refused with a 400.", {"type": "array", "maxItems": 0}
    )
    output_config: Any = _refused("Not supported: refused with a 400.")
    output_format: Any = _refused("Not supported: refused with a 400.")
    context_management: Any = _refused("Not supported: refused with a 400.")


class MessagesRequest(MessagesInput):
    """POST /v1/messages."""

    max_tokens: int = Field(
        ...,
        ge=0,
        description="Most tokens to generate (required, as Anthropic; at most "
        "server.max_tokens_limit). 0 only writes the prompt to the cache (pre-warming): no "
        "content, not with stream.",
    )
    stop_sequences: list[str] | None = Field(
        None, max_length=16, description="Up to 16 non-empty strings that end the text."
    )
    temperature: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description="In [0, 1]; default 1."
    )
    top_p: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass in [0, 1]."
    )
    top_k: int | None = Field(None, ge=0, description="Sample from the k likeliest tokens only.")
    metadata: MessageMetadata | None = None
    stream: bool = Field(False, description="Stream Anthropic's server-sent events.")
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description='Both mean standard capacity here (usage.service_tier "standard").'
    )
    container: Any = _refused("Not supported: refused with a 400.")
    inference_geo: Any = _refused("Not supported: refused with a 400.")
    speed: Any = _refused('Only "standard"; "fast" is refused with a 400.', {"const": "standard"})
    diagnostics: Any = _refused("Not supported: refused with a 400.")
    user_profile_id: Any = _refused("Not supported: refused with a 400.")
    workspace_id: Any = _refused("Not supported: refused with a 400.")


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens."""


# ----------------------------------------------------------------------------------- responses


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int = Field(
        ...,
        description="Prompt tokens neither read from the cache nor written at a cache "
        "breakpoint (those after the last breakpoint that were not reused).",
    )
    cache_creation_input_tokens: int = Field(
        ..., description="Prompt tokens up to the last cache breakpoint this request wrote."
    )
    cache_read_input_tokens: int = Field(
        ...,
        description="Prompt tokens whose KV was reused from the cache (kvfuse caches prefixes "
        "automatically too: also without cache_control).",
    )
    cache_creation: CacheCreation
    output_tokens: int
    service_tier: Literal["standard"] = "standard"


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(..., description="toolu_ and 24 letters or digits.")
    name: str
    input: dict[str, Any]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextContent | ToolUseContent]
    model: str
    stop_reason: Literal[
        "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
    ]
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int = Field(..., description="The prompt's tokens, as the model sees them.")


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer of the Messages API."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject
    request_id: str | None = None
