"""Messages API request bodies -> one engine call, as ``translate`` does for OpenAI's bodies.

A Messages request becomes chat messages the engine's ``PromptBuilder`` renders with the model's
chat template: ``system`` (a string or text blocks) first, then the messages, consecutive
messages of one role combined into one (as Anthropic combines consecutive turns), text blocks
joined with newlines. Each ``cache_control`` (on a system block, on a message's text block, or
top-level: the end of the last message) is a *mark* ``(chat message, character offset, ttl)``;
the builder finds the prompt position of each mark by rendering the template around markers
(``PromptBuilder.breakpoint_positions``), and each position is a ``Breakpoint`` of the engine's
cache: the prefix up to there is stored even mid-chunk and kept at least its ttl.

Every failure is an ``APIError`` found before anything is queued (a 400 naming the field, in
Anthropic's shape on these routes). Everything except ``plan_messages`` and ``count_tokens``
(which run the tokenizer) is pure and table-tested in ``tests/unit/test_anthropic_api.py``.

Tool use (``anthropic_tools``): a ``tool_use`` block becomes a tool call of its assistant chat
message and a ``tool_result`` block a ``tool`` chat message; ``kvfuse.tools.render`` then renders
them, and the tools, as the chat template takes them (its ``tools`` argument, or kvfuse's prompted
format), and a forced ``tool_choice`` (``any`` / ``tool``) ends the prompt with the call's opening
and constrains decoding with the call's grammar, as on the OpenAI chat route. A ``cache_control``
on a tool definition marks the start of the first non-system message (the tools are rendered in
the system turn), one on a ``tool_use`` block the end of its message's text before the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from kvfuse.engine import Breakpoint, CacheOptions, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.models.tokenizer import ChatTemplateError
from kvfuse.prompts.encode import encode_chat
from kvfuse.tools import Rendered, ToolCalling, ToolsError, detect, render, tool_calling

from .anthropic_schemas import (
    CacheControlEphemeral,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from .anthropic_tools import ToolUse, call_of, new_tool_use_id, result_text, tool_use
from .errors import bad_request
from .translate import EngineCall, Limits, Prompting, forced_prompt, with_tools

MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True)
class Mark:
    """A cache breakpoint in the chat messages: after ``offset`` characters of message
    ``message``'s content, kept at least ``ttl_s``."""

    message: int
    offset: int
    ttl_s: float


@dataclass
class Turn:
    """One chat message being built: its role, text pieces and the marks at their ends (after
    how many pieces), an assistant's calls, the call a ``tool`` message answers."""

    role: str
    texts: list[str] = field(default_factory=list)
    marks: list[tuple[int, float]] = field(default_factory=list)  # (pieces before it, ttl_s)
    calls: list[dict[str, Any]] = field(default_factory=list)
    call_id: str | None = None

    def add(self, text: str, cache_control: CacheControlEphemeral | None) -> None:
        self.texts.append(text)
        self.mark(cache_control)

    def mark(self, cache_control: CacheControlEphemeral | None) -> None:
        """A breakpoint at the end of the text so far (None: none)."""
        if cache_control is not None:
            self.marks.append((len(self.texts), TTL_SECONDS[cache_control.ttl]))

    @property
    def content(self) -> str:
        return "\n".join(self.texts)

    def offsets(self) -> list[tuple[int, float]]:
        """``(character offset of the end of the marked pieces in content, ttl_s)`` per mark."""
        ends, end = [0], -1
        for text in self.texts:
            end += len(text) + 1
            ends.append(end)
        return [(ends[n], ttl) for n, ttl in self.marks]

    def message(self) -> dict[str, Any]:
        """The chat message (OpenAI's shape, as ``kvfuse.tools.render`` takes it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.calls:
            out["tool_calls"] = self.calls
        if self.call_id is not None:
            out["tool_call_id"] = self.call_id
        return out


@dataclass(frozen=True)
class Conversation:
    """The chat messages a request renders to, and its cache marks in prompt order."""

    messages: list[dict[str, Any]]
    marks: list[Mark]
    tools: ToolUse | None = None


@dataclass(frozen=True)
class MessagesCall:
    """A planned Messages request: the engine call, the ``max_tokens`` asked for (0: pre-warm
    the cache only), whether it streams."""

    call: EngineCall
    max_tokens: int
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()  # the request's own (not the tools' stop strings)

    @property
    def breakpoints(self) -> tuple[Breakpoint, ...]:
        return self.call.cache.breakpoints


# ---------------------------------------------------------------------------- refused fields

# Anthropic's fields kvfuse does not implement: (field, value allowed, why). Present and not
# allowed -> a 400 naming the field.
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "thinking",
        lambda v: v is None or v == {"type": "disabled"},
        'extended thinking is not supported by this server; omit it or send {"type": "disabled"}',
    ),
    ("speed", lambda v: v in (None, "standard"), 'only "standard" speed is available here'),
    ("mcp_servers", lambda v: v is None or v == [], "MCP servers are not supported here"),
    ("output_config", lambda v: v is None, "output_config is not supported by this server"),
    ("output_format", lambda v: v is None, "structured outputs are not supported by this server"),
    ("context_management", lambda v: v is None, "context management is not supported here"),
    ("container", lambda v: v is None, "containers (code execution) are not supported here"),
    ("inference_geo", lambda v: v is None, "inference_geo is not supported by this server"),
    ("diagnostics", lambda v: v is None, "diagnostics are not supported by this server"),
    ("user_profile_id", lambda v: v is None, "user profiles are not supported by this server"),
    ("workspace_id", lambda v: v is None, "workspaces are not supported by this server"),
)


def refuse_unsupported(req: MessagesInput) -> None:
    """A 400 naming the first field of Anthropic's API that this server does not implement."""
    for name, allowed, why in _REFUSED:
        if name in req.model_fields_set and not allowed(getattr(req, name, None)):
            raise bad_request(f"{name}: {why}", param=name, code="unsupported_parameter")


# ------------------------------------------------------------------------------ content blocks


Block = TextBlock | ToolUseBlock | ToolResultBlock


def _block(model: type[Block], where: str, block: dict[str, Any]) -> Block:
    try:
        parsed = model.model_validate(block)
    except ValidationError as e:
        err = e.errors()[0]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        raise bad_request(f"{where}{path}: {err['msg']}", param="messages") from None
    texts = [parsed] if isinstance(parsed, TextBlock) else []
    if isinstance(parsed, ToolResultBlock) and isinstance(parsed.content, list):
        texts = parsed.content
    if any(t.citations is not None for t in texts):
        raise bad_request(
            f"{where}.citations: citations are not supported by this server", param="messages"
        )
    return parsed


# Content block parsers by type.
_BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
}


def content_blocks(where: str, content: str | list[dict[str, Any]]) -> list[Block]:
    """A message's content as blocks; a 400 naming the block for an unsupported type, for empty
    content and for malformed blocks."""
    if isinstance(content, str):
        if not content:
            raise bad_request(
                f"{where}.content: all messages must have non-empty content", param="messages"
            )
        return [TextBlock(type="text", text=content)]
    if not content:
        raise bad_request(
            f"{where}.content: all messages must have non-empty content", param="messages"
        )
    blocks = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        model = _BLOCKS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"{at}: content blocks of type {kind!r} are not supported by this server; "
                "send text, tool_use or tool_result blocks",
                param="messages",
                code="unsupported_content",
            )
        blocks.append(_block(model, at, block))
    return blocks


# -------------------------------------------------------------------------------- conversation


def _system(req: MessagesInput) -> list[Turn]:
    """``system`` as a turn (none when absent or empty)."""
    if isinstance(req.system, str):
        return [Turn("system", [req.system])] if req.system else []
    if not req.system:
        return []
    turn = Turn("system")
    for block in req.system:
        if block.citations is not None:
            raise bad_request("system: citations are not supported", param="system")
        turn.add(block.text, block.cache_control)
    return [turn]


def _add_block(turns: list[Turn], where: str, role: str, block: Block) -> None:
    """One content block of a ``role`` message onto the turns: text joins the last turn of its
    role (consecutive turns combine), a call joins the assistant's turn, a result is a turn."""
    if isinstance(block, ToolResultBlock):
        if role != "user":
            raise bad_request(f"{where}: tool_result blocks go in user messages", param="messages")
        turn = Turn("tool", call_id=block.tool_use_id)
        turn.add(result_text(block), None)
        for piece in block.content if isinstance(block.content, list) else ():
            turn.mark(piece.cache_control)  # a mark within a result: at its end
        turn.mark(block.cache_control)
        turns.append(turn)
        return
    if isinstance(block, ToolUseBlock) and role != "assistant":
        raise bad_request(f"{where}: tool_use blocks go in assistant messages", param="messages")
    if not turns or turns[-1].role != role:
        turns.append(Turn(role))
    if isinstance(block, ToolUseBlock):
        turns[-1].calls.append(call_of(block))
        turns[-1].mark(block.cache_control)
    else:
        turns[-1].add(block.text, block.cache_control)


def _turns(req: MessagesInput) -> list[Turn]:
    """``system`` and the messages as chat turns, consecutive same-role messages combined."""
    turns = _system(req)
    if not req.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    for i, m in enumerate(req.messages):
        for j, block in enumerate(content_blocks(f"messages[{i}]", m.content)):
            _add_block(turns, f"messages[{i}].content[{j}]", m.role, block)
    if turns[-1].role not in ("user", "tool"):
        raise bad_request(
            f"messages: the last message must be a user message (got {turns[-1].role!r}); "
            "this server does not continue a partial assistant message (prefill)",
            param="messages",
        )
    return turns


def check_marks(marks: list[Mark]) -> None:
    """Anthropic's rules on breakpoints: at most four, and a 1h one never after a 5m one."""
    if len(marks) > MAX_BREAKPOINTS:
        raise bad_request(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marks)}.",
            param="cache_control",
        )
    shortest = None
    for mark in marks:
        if shortest is not None and mark.ttl_s > shortest:
            raise bad_request(
                'cache_control: a ttl of "1h" cannot come after one of "5m" (breakpoints with '
                "a longer ttl must come first)",
                param="cache_control",
            )
        shortest = mark.ttl_s if shortest is None else min(shortest, mark.ttl_s)


def conversation(req: MessagesInput) -> Conversation:
    """The chat messages, cache marks and tools of a request (pure; 400s for what cannot be
    rendered)."""
    refuse_unsupported(req)
    turns = _turns(req)
    messages = [t.message() for t in turns]
    try:
        tools = tool_use(
            req.tools, req.tool_choice, any(t.calls or t.role == "tool" for t in turns)
        )
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None
    marks = [Mark(i, offset, ttl) for i, t in enumerate(turns) for offset, ttl in t.offsets()]
    first = next((i for i, t in enumerate(turns) if t.role != "system"), 0)
    tool_marks = [  # the tools are rendered in the system turn: before the first other message
        Mark(first, 0, TTL_SECONDS[d.cache_control.ttl])
        for d in req.tools or ()
        if d.cache_control is not None
    ]
    if req.cache_control is not None:  # automatic caching: the end of the last block
        marks.append(
            Mark(len(turns) - 1, len(messages[-1]["content"]), TTL_SECONDS[req.cache_control.ttl])
        )
    check_marks(tool_marks + marks)
    return Conversation(messages, tool_marks + marks, tools)


# ------------------------------------------------------------------------------------ sampling


def sampling(req: MessagesRequest, prompt_tokens: int, limits: Limits) -> SamplingParams:
    """``SamplingParams`` within the server's limits. A ``max_tokens`` the context window cannot
    hold after the prompt is cut to what it can (the text then ends with
    ``model_context_window_exceeded``); 0 (pre-warming the cache) generates one token, not
    returned."""
    if prompt_tokens >= limits.context_window:
        raise bad_request(
            f"prompt is too long: {prompt_tokens} tokens > {limits.context_window - 1} maximum "
            "(the model's context window, with room for one output token)",
            param="messages",
            code="context_length_exceeded",
        )
    if req.max_tokens > limits.max_tokens_limit:
        raise bad_request(
            f"max_tokens: {req.max_tokens} > {limits.max_tokens_limit}, which is the maximum "
            f"allowed number of output tokens here (server.max_tokens_limit)",
            param="max_tokens",
        )
    if req.max_tokens == 0 and req.stream:
        raise bad_request(
            "max_tokens: 0 only writes the prompt to the cache, which cannot be streamed",
            param="max_tokens",
        )
    top_p, top_k = 1.0 if req.top_p is None else req.top_p, req.top_k or 0
    if top_p == 0.0:  # the smallest set of tokens with mass >= 0: the likeliest one
        top_p, top_k = 1.0, 1
    try:
        return SamplingParams(
            max_tokens=max(1, min(req.max_tokens, limits.context_window - prompt_tokens)),
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=top_p,
            top_k=top_k,
            stop=tuple(req.stop_sequences or ()),
        )
    except ValueError as e:  # SamplingParams names the field first: "stop must be ..."
        name = str(e).split(" ", 1)[0]
        name = "stop_sequences" if name == "stop" else name
        raise bad_request(f"{name}: {str(e).split(' ', 1)[1]}", param=name) from None


# ------------------------------------------------------------------------ prompts (tokenizer)


def calling(p: Prompting, conv: Conversation, grammar: bool = True) -> ToolCalling | None:
    """The request's ``ToolCalling`` for the served model (None without tools); ``grammar``:
    compile a forced call's grammar (not needed to count tokens)."""
    if conv.tools is None:
        return None
    t, model = conv.tools, p.prompts.model
    fmt = detect(model.tokenizer.chat_template)
    skip = None if grammar else (lambda *_: None)
    try:
        tools = tool_calling(fmt, t.tools, t.choice, t.parallel, model, skip)
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None
    return replace(tools, new_id=new_tool_use_id)


def rendered(p: Prompting, conv: Conversation, tools: ToolCalling | None) -> Rendered:
    """The messages (and tools) as the chat template takes them."""
    if tools is None:
        return Rendered.plain(conv.messages)
    try:
        return render(conv.messages, tools.fmt, tools.tools)
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None


def _encode(p: Prompting, chat: Rendered) -> list[int]:
    """The rendered conversation's ids: never truncated (Anthropic answers a prompt too long
    with a 400 rather than dropping turns)."""
    try:
        ids = encode_chat(p.prompts.model.tokenizer, chat.messages, chat.tools)
    except ChatTemplateError as e:
        raise bad_request(
            f"messages: {e}", param="messages", code="invalid_chat_template"
        ) from None
    if not ids:
        raise bad_request("messages: the rendered conversation is empty", param="messages")
    return ids


def breakpoints(
    p: Prompting, conv: Conversation, chat: Rendered, ids: list[int]
) -> tuple[Breakpoint, ...]:
    """The engine's breakpoints at the marks' prompt positions (a mark the template does not
    keep verbatim has none)."""
    if not conv.marks:
        return ()
    positions = p.prompts.breakpoint_positions(
        chat.messages, [chat.mark(m.message, m.offset) for m in conv.marks], ids, chat.tools
    )
    return tuple(sorted({Breakpoint(at, m.ttl_s) for at, m in zip(positions, conv.marks) if at}))


def plan_messages(p: Prompting, req: MessagesRequest, tenant: str, limits: Limits) -> MessagesCall:
    """Render, tokenize and check a Messages request (call it off the event loop)."""
    conv = conversation(req)
    tools = calling(p, conv)
    chat = rendered(p, conv, tools)
    ids = _encode(p, chat)
    prompt = forced_prompt(p, Prompt.plain(ids), tools)
    params = sampling(req, len(prompt), limits)
    cache = CacheOptions(tenant=tenant, breakpoints=breakpoints(p, conv, chat, ids))
    call = with_tools(EngineCall(prompt, params, cache), tools)
    return MessagesCall(call, req.max_tokens, req.stream, tuple(req.stop_sequences or ()))


def count_tokens(p: Prompting, req: MessagesInput) -> int:
    """The prompt tokens of a request, as /v1/messages would render them (with a forced call's
    opening)."""
    conv = conversation(req)
    tools = calling(p, conv, grammar=False)
    ids = _encode(p, rendered(p, conv, tools))
    return len(forced_prompt(p, Prompt.plain(ids), tools))
