"""Request and response bodies of the OpenAI-compatible API (pydantic models; they are the OpenAPI schema).

Requests are validated strictly: a known field of the wrong JSON type (``"max_tokens": "5"``) is a
400, never silently coerced; unknown fields are ignored, as OpenAI does. Every request body is
composed of three layers::

    KVFuseOptions        kvfuse's own extension fields (cache_salt, cache, ...), flattened into the body
    SamplingRequest      the OpenAI fields shared by /v1/completions and /v1/chat/completions
    CompletionRequest / ChatCompletionRequest   the prompt or the messages

An extension (RAG ``documents`` and ``recompute_ratio``; later a multi-turn ``session_id``, a
``ttft_slo_ms`` target) is a field added to ``KVFuseOptions`` plus its mapping in ``translate``:
both endpoints and the OpenAPI schema pick it up unchanged. Values that depend on the configuration (max_tokens above
``server.max_tokens_limit``, the model name) are checked in ``translate``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Request models: types checked strictly, and a field kvfuse does not implement is refused
    with a 400 naming it (``errors.unsupported_field``), never dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")


# ------------------------------------------------------------------------------------ requests


# A cache_salt may not hold NUL: the namespace joins its salts with it (a salt holding one could
# spell another namespace's).
NO_NUL = r"^[^\x00]*$"


class KVFuseOptions(_Strict):
    """kvfuse extension fields (with the ``openai`` client: ``extra_body={...}``)."""

    cache_salt: str | None = Field(
        None,
        max_length=256,
        pattern=NO_NUL,
        description="kvfuse extension: an extra cache namespace inside the caller's tenant (no NUL "
        "character: it separates a namespace's salts). Requests share "
        "cached KV only when they have the same tenant and the same cache_salt.",
        examples=["project-42"],
    )
    cache: bool = Field(
        True,
        description="kvfuse extension: false bypasses the KV cache for this request (nothing is read from it "
        "and nothing is written to it).",
    )
    documents: list[str] | None = Field(
        None,
        max_length=128,
        description="kvfuse extension (CacheBlend): retrieved documents placed before the prompt (completions) or "
        "at the start of the last user message (chat). Each document's KV is computed on its own once, "
        "cached, and reused at any position in any later prompt; the tokens that deviate most are "
        "recomputed in context (recompute_ratio).",
        examples=[
            ["Velmora is a harbour town on the river Aske.", "Its lighthouse was built in 1847."]
        ],
    )
    recompute_ratio: Ratio | Literal["auto"] | None = Field(
        None,
        description="kvfuse extension: the fraction of document (or found passage) tokens recomputed in context, in "
        '[0, 1] (0: reuse the documents\' KV as it is; 1: a full prefill), or "auto": the budget the '
        "model's calibrated profile found to keep its answers (kvfuse calibrate). Default: the server's "
        "blend.recompute_ratio (auto unless configured). Needs documents or automatic reuse.",
    )
    blend_auto: Literal["on", "off"] | None = Field(
        None,
        description='kvfuse extension (automatic reuse): "on" looks for passages of this plain prompt that '
        "earlier prompts computed (at any position, in any order) and blends their cached KV with the "
        'model\'s calibrated budget (or recompute_ratio); "off" reuses exact prefixes only. Default: '
        "the server's blend.auto. Ignored with documents or cache breakpoints; nothing is blended when "
        "the model's calibrated blend is prefix (usage.prompt_tokens_details.auto_reuse says so).",
    )
    kv_slo_ms: float | None = Field(
        None,
        gt=0,
        le=3_600_000,
        allow_inf_nan=False,
        description="kvfuse extension (CacheGen streaming): a budget in milliseconds for loading this prompt's KV "
        "from slow tiers (disk, Redis). Each chunk is read at the best encoding that keeps the whole load "
        "within it, or recomputed from its tokens when none does. Default: the server's cache.kv_slo_ms.",
    )


class CacheControl(_Strict):
    """Anthropic-style cache breakpoint on a message part: the prompt up to the end of this part is
    a prefix to store (even mid-chunk), kept at least ``ttl``."""

    type: Literal["ephemeral"] = Field(..., description='Only "ephemeral" (as Anthropic\'s API).')
    ttl: str | None = Field(
        None,
        max_length=32,
        description='How long the prefix is kept at least, e.g. "5m", '
        '"1h", "24h". Default: prompt_cache_options.ttl, '
        "else the tiers' policy.",
        examples=["1h"],
    )


class PromptCacheBreakpoint(_Strict):
    """OpenAI's explicit cache breakpoint on a content part (the same effect as ``cache_control``)."""

    mode: Literal["explicit"] = "explicit"
    ttl: str | None = Field(
        None, max_length=32, description='Minimum lifetime of the prefix, e.g. "30m", "12h".'
    )


class PromptCacheOptions(_Strict):
    """OpenAI's prompt-caching options: ``ttl`` is the default minimum lifetime of breakpoints."""

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: str | None = Field(
        None, max_length=32, description="Default minimum lifetime of cache breakpoints."
    )


class StreamOptions(_Strict):
    include_usage: bool = Field(
        False, description="Send a last chunk (with empty choices) carrying the usage."
    )


_ROUTER_DEFAULT = (
    "SGLang's extension, as vllm-router sends it: only its default value (kvfuse's behaviour)."
)


class SamplingRequest(KVFuseOptions):
    """Fields shared by completions and chat completions."""

    model: str = Field(
        ...,
        description="The served model's name, as listed by GET /v1/models.",
        examples=["smollm2"],
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens to generate (at most server.max_tokens_limit). Default: server.default_max_tokens, "
        "reduced to what fits in the context window.",
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        allow_inf_nan=False,
        description="Sampling temperature in [0, 2]; 0 is greedy decoding. Default 1.",
    )
    top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Nucleus sampling mass in (0, 1]. Default 1.",
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Seed for sampling; the same seed gives the same output."
    )
    stop: str | list[str] | None = Field(
        None,
        description="Up to 16 strings; generation stops before the first one produced (it is not returned).",
    )
    stream: bool | None = Field(
        False, description="Stream the output as server-sent events, ending with data: [DONE]."
    )
    stream_options: StreamOptions | None = Field(
        None, description="Options for streaming (include_usage)."
    )
    ignore_eos: bool | None = Field(
        False,
        description="Keep generating past the end-of-sequence token until max_tokens or a stop string "
        "(vLLM's extension; for benchmarks).",
    )
    # vllm-router re-serializes every body it forwards with SGLang's extension fields at their
    # defaults: accepted at the value that changes nothing here, refused (400) at any other.
    no_stop_trim: Literal[False] | None = Field(None, description=_ROUTER_DEFAULT)
    skip_special_tokens: Literal[True] | None = Field(None, description=_ROUTER_DEFAULT)
    continue_final_message: Literal[False] | None = Field(None, description=_ROUTER_DEFAULT)
    separate_reasoning: Literal[True] | None = Field(None, description=_ROUTER_DEFAULT)
    stream_reasoning: Literal[True] | None = Field(None, description=_ROUTER_DEFAULT)
    return_hidden_states: Literal[False] | None = Field(None, description=_ROUTER_DEFAULT)
    include_reasoning: Literal[True] | None = Field(None, description=_ROUTER_DEFAULT)
    n: int | None = Field(
        1,
        ge=1,
        le=128,
        description="Number of choices to generate from the prompt (1..128). The prompt's KV is "
        "computed (or loaded) once and copied to each choice; usage counts the prompt once and "
        "every choice's tokens. With a seed, choice i samples with a seed derived from it.",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="OpenAI's: count * frequency_penalty is subtracted from the logit of every "
        "token generated count times so far. Default 0.",
    )
    presence_penalty: float | None = Field(
        None,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="OpenAI's: presence_penalty is subtracted from the logit of every token "
        "generated at least once so far. Default 0.",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string key) -> a bias in [-100, 100] added to that token's "
        "logit before sampling.",
        examples=[{"50256": -100}],
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        description="vLLM's extension: sample from the k most likely tokens only (-1 or 0: all).",
    )
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="vLLM's extension: drop tokens less likely than min_p times the most likely "
        "one (after temperature). Default 0.",
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0.0,
        le=100.0,
        allow_inf_nan=False,
        description="vLLM's extension: the logits of tokens in the prompt or generated so far are "
        "divided by it when positive, multiplied when negative (> 1 discourages repeats). Default 1.",
    )
    stop_token_ids: list[int] | None = Field(
        None,
        max_length=64,
        description="vLLM's extension: token ids that end the choice (not returned), "
        "like the end-of-sequence token.",
    )
    user: str | None = Field(
        None,
        max_length=256,
        description="An end-user id: its conversations are lined up only with its own, and it "
        "names the conversation (usage reports cached_tokens exactly, not in whole chunks).",
    )
    prompt_cache_key: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="OpenAI's prompt-caching key: requests with the same key (and tenant and cache_salt) are one "
        "conversation, and a turn is lined up with that conversation's stored history first. Without it "
        "kvfuse finds the history by content.",
        examples=["conversation-1234"],
    )
    prompt_cache_retention: str | None = Field(
        None,
        max_length=32,
        description='How long the KV entries this request writes stay: "in_memory" (the memory tier only, until '
        'evicted) or a duration ("24h", "30m", "7d": every tier, expiring that long after '
        "being written; entries it reuses are kept at least that long too). Default: the server's "
        "cache.retention (none: every tier, until evicted).",
        examples=["24h"],
    )
    prompt_cache_options: PromptCacheOptions | None = Field(
        None,
        description="OpenAI's prompt-caching options; ttl is the default minimum lifetime of breakpoints.",
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description='Structured outputs, as OpenAI: {"type": "text"}, {"type": "json_object"} (a JSON '
        'object; the messages must mention JSON), or {"type": "json_schema", "json_schema": {"name", '
        '"schema", "strict", "description"}}: the output is constrained token by token to JSON valid '
        "against the schema (grammar engine: llguidance). strict: true refuses schema keywords that "
        "cannot be enforced (400); false ignores them.",
        examples=[
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                },
            }
        ],
    )
    guided_json: dict[str, Any] | str | None = Field(
        None,
        description="vLLM's extension: a JSON Schema (or its JSON text) the output must match.",
    )
    guided_regex: str | None = Field(
        None, description="vLLM's extension: a regular expression the whole output must match."
    )
    guided_choice: list[str] | None = Field(
        None, description="vLLM's extension: the output is exactly one of these strings."
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's extension: one of json (a schema), regex, choice or json_object: true.",
    )
    guided_decoding_backend: str | None = Field(
        None, description="vLLM's extension: auto, guidance or llguidance (the one backend)."
    )
    guided_grammar: Any = Field(None, description="vLLM's extension: not supported (400).")
    guided_whitespace_pattern: Any = Field(
        None, description="vLLM's extension: not supported (400): the JSON layout is fixed."
    )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="Return the logprob of each generated token and of the `logprobs` most likely "
        "tokens at each position (0..5), in the legacy shape (tokens, token_logprobs, "
        "top_logprobs, text_offset). Logprobs are the model's raw distribution's (before "
        "penalties, bias and temperature).",
    )
    echo: bool | None = Field(
        False,
        description="Return the prompt before each choice's text; with logprobs, the prompt "
        "tokens' logprobs come first (the first token's is null). Costs one more pass over the "
        "prompt when logprobs are asked (cached or not).",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        description="Only best_of equal to n (or 1 with n = 1) is accepted: every candidate "
        "is returned. Ranking more candidates than n is not supported (a 400).",
    )

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ...,
        description="The prompt: a string, a list holding one string, a list of token ids, or a list holding one "
        "list of token ids. Must not be empty.",
        examples=["The capital of France is"],
    )


class TextPart(_Strict):
    type: Literal["text"] = Field(..., description="Only text parts are supported.")
    text: str
    cache_control: CacheControl | None = Field(
        None,
        description="A cache breakpoint after this part (Anthropic-style): the prompt up to here is stored "
        "as a prefix, even when it does not end on a chunk boundary.",
    )
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = Field(
        None, description="A cache breakpoint after this part (OpenAI-style); as cache_control."
    )


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(..., description="The arguments, a JSON object as a string.")


class ToolCall(_Strict):
    """A call an assistant message made (OpenAI's ``tool_calls[i]``)."""

    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str = Field(
        ..., description="1 to 64 letters, digits, underscores or dashes; unique per request."
    )
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description='The arguments\' JSON schema ("type": "object"); none: no arguments.',
    )
    strict: bool | None = Field(
        None,
        description="With tool_choice required or this function, kvfuse always constrains the "
        "arguments to the schema; strict is passed on to the grammar compiler.",
    )


class ChatTool(_Strict):
    type: Literal["function"] = Field(..., description="Only function tools.")
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolFields(_Strict):
    """OpenAI's function-calling fields of a chat completion request (``kvfuse.tools``)."""

    tools: list[ChatTool] | None = Field(
        None,
        max_length=128,
        description="Functions the model may call. Rendered with the model's chat template when it "
        "supports tools (Qwen2.5, Llama 3.x), else in kvfuse's prompted format (docs/api.md).",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"auto" (default): the output is parsed for calls; "none": never; "required" or '
        '{"type": "function", "function": {"name": ...}}: exactly one call, decoding '
        "constrained to the call's JSON schema.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call per answer. Default true."
    )
    functions: list[dict[str, Any]] | None = Field(
        None, description="Deprecated by OpenAI; refused: use tools."
    )
    function_call: str | dict[str, Any] | None = Field(
        None, description="Deprecated by OpenAI; refused: use tool_choice."
    )


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None,
        description='A string or a list of {"type": "text", "text": ...} parts (joined with newlines).',
    )
    name: str | None = None
    cache_control: CacheControl | None = Field(
        None, description="A cache breakpoint at the end of this message's content (as on a part)."
    )
    tool_calls: list[ToolCall] | None = Field(
        None, description="The calls an assistant message made."
    )
    tool_call_id: str | None = Field(
        None, description="For a tool message: the id of the call it answers."
    )


class ChatCompletionRequest(ToolFields, SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        ...,
        min_length=1,
        description="The conversation so far, rendered with the model's chat template.",
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate; takes precedence over max_tokens."
    )
    logprobs: bool | None = Field(
        False,
        description="Return the logprob of each generated token (choices[].logprobs.content), "
        "under the model's raw distribution (before penalties, bias and temperature).",
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="With logprobs: the most likely alternatives (0..20) to list at each position.",
    )


class ResponseCreateRequest(KVFuseOptions):
    """POST /v1/responses (OpenAI's Responses API; text in, text out)."""

    model: str = Field(
        ...,
        description="The served model's name, as listed by GET /v1/models.",
        examples=["smollm2"],
    )
    input: str | list[dict[str, Any]] = Field(
        ...,
        description='A string (one user message) or a list of messages: {"role", "content"} with content a '
        'string or a list of {"type": "input_text" | "output_text", "text"} parts (a part may '
        "carry cache_control or prompt_cache_breakpoint).",
    )
    instructions: str | None = Field(
        None,
        description="A system message placed first (not carried over to a "
        "follow-up's previous_response_id).",
    )
    previous_response_id: str | None = Field(
        None,
        max_length=128,
        description="Continue the conversation of a stored response: its history (and its KV) "
        "is used without being sent again.",
    )
    store: bool = Field(
        True,
        description="Keep this response so that a later request can name it "
        "(previous_response_id) or GET it.",
    )
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        allow_inf_nan=False,
        description="Sampling temperature in [0, 2]; 0 is greedy decoding. Default 1.",
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="kvfuse extension: seed for sampling."
    )
    stream: bool | None = Field(
        False,
        description="Stream server-sent events (response.created, "
        "response.output_text.delta, ..., response.completed).",
    )
    metadata: dict[str, str] | None = Field(
        None, max_length=16, description="Up to 16 key-value pairs, kept."
    )
    user: str | None = None
    prompt_cache_key: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="As on chat completions: names a conversation's stored history.",
    )
    prompt_cache_retention: str | None = Field(
        None,
        max_length=32,
        description='As on chat completions: "in_memory" or a duration such as "24h".',
    )
    prompt_cache_options: PromptCacheOptions | None = None
    ignore_eos: bool | None = Field(
        False, description="kvfuse extension: generate past the end-of-sequence token."
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        max_length=128,
        description='Function tools: {"type": "function", "name", "description", "parameters", '
        '"strict"} (other tool types are refused). As on chat completions (docs/api.md).',
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"none", "auto" (default), "required" or {"type": "function", "name": ...}: '
        "as on chat completions.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one function call. Default true."
    )
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description='With include: ["message.output_text.logprobs"]: the most likely '
        "alternatives (0..20) listed with each output token's logprob.",
    )
    include: list[str] | None = Field(
        None,
        max_length=16,
        description='Extra output to include; only "message.output_text.logprobs" (each output '
        "token's logprob under the model's raw distribution) is supported.",
    )
    text: dict[str, Any] | None = Field(
        None,
        description='The output\'s format, as OpenAI: {"format": {"type": "text"}}, {"format": {"type": '
        '"json_object"}} (the input must mention JSON) or {"format": {"type": "json_schema", "name", '
        '"schema", "strict", "description"}}: the output is constrained to JSON valid against the '
        "schema.",
    )


# ----------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        ..., description="Prompt tokens whose KV was reused from the cache (not prefilled)."
    )
    recomputed_tokens: int = Field(
        0,
        description="kvfuse extension: document tokens whose cached KV was recomputed "
        "in context (documents requests).",
    )
    cached_entries_by_tier: dict[str, int] = Field(
        default_factory=dict,
        description="kvfuse extension: where the reused KV came from: entries read per tier "
        "(memory, disk, redis).",
    )
    save_ms: float = Field(
        0.0,
        description="kvfuse extension: milliseconds this request spent on saving its KV on the "
        "request path (the saving itself runs in the background).",
    )
    kv_stream: dict[str, Any] | None = Field(
        None,
        description="kvfuse extension: how chunks in slow tiers were streamed within kv_slo_ms: chunks per "
        'encoding ("raw", "cachegen.2", ... or "recompute"), load_ms, slo_ms, met.',
    )
    blend: dict[str, Any] | None = Field(
        None,
        description="kvfuse extension (requests with documents, or found passages): how the documents' KV was "
        "used: method (hkvd, ..., or prefix: not blended, reused only as an exact prefix), "
        "recompute_ratio (the budget) and source (what decided it: profile, default, config or "
        "request).",
    )
    prefix_reused_tokens: int = Field(
        0,
        description="kvfuse extension: of cached_tokens, those loaded at their own "
        "positions (an exact prefix, a stored conversation).",
    )
    span_reused_tokens: int = Field(
        0,
        description="kvfuse extension: of cached_tokens, those of documents and of "
        "passages found at other positions (blended).",
    )
    prefilled_tokens: int = Field(
        0,
        description="kvfuse extension: prompt tokens computed for this request "
        "(prompt_tokens - cached_tokens; recomputed_tokens among them).",
    )
    auto_reuse: str = Field(
        "off",
        description="kvfuse extension (automatic reuse): off (not asked), skipped (documents, "
        "cache breakpoints, no cache), prefix (the model's calibrated blend "
        "is prefix: no passage is blended), none_found, or blended.",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: dict[str, Any] | None = Field(
        None,
        description="With logprobs: tokens, token_logprobs, top_logprobs (token text -> "
        "logprob) and text_offset, one entry per token (prompt tokens first with echo).",
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(..., description="The text; null when the answer is only calls.")
    tool_calls: list[ToolCall] | None = Field(
        None, description="The calls the model made (requests with tools); absent when none."
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: dict[str, Any] | None = Field(
        None,
        description='With logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}, '
        '...], "refusal": null}.',
    )


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "vllm"  # server.owned_by: what routers detect a vLLM-type worker by
    root: str | None = None  # vLLM's: the model the served name stands for
    max_model_len: int | None = None  # vLLM's: the context window


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "starting", "draining", "wedged"] = Field(
        "ok",
        description="ok (200); starting, draining or wedged (503: routers take the server out).",
    )
    model: str
    waiting: int = Field(..., description="Requests waiting in the queue.")
    running: int = Field(..., description="Requests being generated.")
    engine: dict[str, int | float | bool] = Field(
        default_factory=dict,
        description="The engine loop's progress: progress_steps, seconds_since_progress (while "
        "there is work), failing_steps (in a row), failed_steps, wedged.",
    )


class KVStats(BaseModel):
    cache_enabled: bool
    tiers: dict[str, dict[str, int | float | None]] = Field(
        ...,
        description="Counters per tier (hits, misses, bytes_in, bytes_out, evictions, errors, entries, "
        "used_bytes, ...) and the store's own under 'store'. Global, not per tenant.",
    )
    engine: dict[str, int | float | dict[str, int | float]] = Field(
        ...,
        description="Engine counters: requests, prompt_tokens, tokens_reused, tokens_prefilled, history "
        "reuse, truncation, and the saver's counters under 'saver' (seconds are floats), ...",
    )
    queue: dict[str, int]


class KVDeleted(BaseModel):
    tenant: str = Field(
        ..., description="The caller's tenant ('' when the server has no API keys)."
    )
    cache_salt: str | None = Field(
        None,
        description="The salt cleared (every namespace derived from it: plain prompts, blended "
        "prompts, continued conversations, every model), or null: all of the tenant's.",
    )
    deleted: dict[str, int] = Field(..., description="Entries removed per tier.")
    complete: bool = Field(
        True,
        description="False (with status 202) when the saves queued under the cleared prefix were "
        "not all written within half of server.maintenance_timeout_s: what was stored is deleted, "
        "but a write still queued may land afterwards; repeat the request to remove it.",
    )
