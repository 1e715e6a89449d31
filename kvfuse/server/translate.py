"""Request bodies -> one engine call: the prompt (token ids, or segments with ``documents``),
``SamplingParams``, ``CacheOptions`` and the blend options.

Everything a request can get wrong is found here, before the request is queued, so that a
streaming response never has to report a bad request after its 200 went out. Every failure is an
``APIError`` (400 naming the field) and the functions other than ``plan_*`` are pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from kvfuse.durations import parse_duration
from kvfuse.engine import Breakpoint, CacheOptions, Delta, Outcome, Prompt, Request, Retention
from kvfuse.generation import SamplingParams
from kvfuse.models.tokenizer import ChatTemplateError
from kvfuse.prompts import PromptBuilder
from kvfuse.prompts.prompt import Segment, SegmentKind
from kvfuse.tools import (
    Rendered,
    ToolCalling,
    ToolsError,
    choice_from_openai,
    detect,
    render,
    tool_calling,
    tools_from_openai,
    uses_tools,
)

from .errors import APIError, bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, KVFuseOptions, SamplingRequest
from .structured import Grammars, compile_format, request_format, require_json_word


@dataclass(frozen=True)
class EngineCall:
    """What one HTTP request asks the engine for."""

    prompt: Prompt
    params: SamplingParams
    cache: CacheOptions
    # the request's recompute budget over the engine's blend options (None: the engine's)
    recompute_ratio: float | str | None = None
    # the request's tools: how its output becomes calls (None: no tools, plain text)
    tools: ToolCalling | None = None
    # a chat's oldest messages dropped to fit the context window (``truncate.without_oldest``)
    dropped_messages: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    def request(
        self,
        request_id: str,
        on_text: Callable[[str], None] | None = None,
        on_done: Callable[[Outcome], None] | None = None,
        on_delta: Callable[[Delta], None] | None = None,
    ) -> Request:
        """The engine request (its callbacks run on the engine thread)."""
        return Request(
            self.prompt,
            self.params,
            self.cache,
            recompute_ratio=self.recompute_ratio,
            request_id=request_id,
            on_text=on_text,
            on_delta=on_delta,
            on_done=on_done,
        )


@dataclass(frozen=True)
class Prompting:
    """What translating a request needs of the running server: its prompt builder (shared with
    the engine: ``runtime.open_serving``) and whether plain prompts look for cached passages
    unless a request says otherwise (``blend.auto``)."""

    prompts: PromptBuilder
    auto_reuse: bool = False
    # compiles structured-output grammars for the served model (None: one with the default cache)
    grammars: Grammars | None = None


@dataclass(frozen=True)
class Limits:
    """What the configuration and the model allow."""

    max_tokens_limit: int
    default_max_tokens: int
    context_window: int
    vocab_size: int | None = None  # token ids in logit_bias / stop_token_ids are below it


def cache_options(opts: SamplingRequest, tenant: str) -> CacheOptions:
    """The engine's cache behaviour for a request of ``tenant`` (its extension fields and its
    prompt-caching fields)."""
    return CacheOptions(
        enabled=opts.cache,
        tenant=tenant,
        salt=opts.cache_salt or "",
        history_key=opts.prompt_cache_key,
        user=opts.user,
        kv_slo_ms=opts.kv_slo_ms,
        retention=retention(opts.prompt_cache_retention),
        auto_reuse=None if opts.blend_auto is None else opts.blend_auto == "on",
    )


def retention(value: str | None) -> Retention | None:
    """``prompt_cache_retention`` as the engine's ``Retention`` (None: the server's default)."""
    if value is None:
        return None
    try:
        return Retention.parse(value)
    except ValueError as e:
        raise bad_request(f"prompt_cache_retention: {e}", param="prompt_cache_retention") from None


def ttl_seconds(value: str | None, param: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


MAX_BREAKPOINTS = 16


def chat_marks(req: ChatCompletionRequest) -> list[tuple[int, int, float | None]]:
    """The cache breakpoints of a chat request's messages: ``(message index, character offset in
    its content as ``chat_messages`` joins it, ttl in seconds)``, from ``cache_control`` or
    ``prompt_cache_breakpoint`` on parts and ``cache_control`` on messages."""
    opts = req.prompt_cache_options
    default = ttl_seconds(opts.ttl, "prompt_cache_options.ttl") if opts is not None else None
    marks = []
    for i, m in enumerate(req.messages):
        end = 0
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                end += len(part.text) + (j > 0)  # parts are joined with newlines
                for k, mark in enumerate((part.cache_control, part.prompt_cache_breakpoint)):
                    if mark is not None:
                        field = "cache_control" if k == 0 else "prompt_cache_breakpoint"
                        ttl = ttl_seconds(mark.ttl, f"messages[{i}].content[{j}].{field}.ttl")
                        marks.append((i, end, ttl if ttl is not None else default))
        else:
            end = len(m.content or "")
        if m.cache_control is not None:
            ttl = ttl_seconds(m.cache_control.ttl, f"messages[{i}].cache_control.ttl")
            marks.append((i, end, ttl if ttl is not None else default))
    if len(marks) > MAX_BREAKPOINTS:
        raise bad_request(
            f"messages: at most {MAX_BREAKPOINTS} cache breakpoints per request, got {len(marks)}",
            param="messages",
        )
    return marks


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids (not yet checked
    against the vocabulary)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(
                f"prompt: give exactly one prompt (got a batch of {len(p)}); send one request per prompt",
                param="prompt",
            )
        p = p[0]
    if len(p) == 0:
        raise bad_request("prompt: the prompt is empty", param="prompt")
    return p


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template expects them: role and content strings, an assistant's
    ``tool_calls`` and a tool message's ``tool_call_id`` (``kvfuse.tools.render`` renders them)."""
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            content = "\n".join(part.text for part in m.content)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise bad_request(
                    f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                    param="messages",
                )
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    f"messages[{i}].tool_call_id: a tool message names the call it answers",
                    param="messages",
                )
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def request_tools(p: Prompting, req: ChatCompletionRequest) -> ToolCalling | None:
    """The request's tools, choice and parallel_tool_calls, checked (None: no tools); a forced
    choice's grammar is compiled here."""
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(
                f"{name}: deprecated by OpenAI and not supported; use "
                f"{'tools' if name == 'functions' else 'tool_choice'}",
                param=name,
            )
    if req.tools is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                raise bad_request(f"{name}: only allowed when tools are specified", param=name)
        return None
    model, raw = p.prompts.model, req.tool_choice
    try:
        tools = tools_from_openai([t.model_dump(exclude_none=True) for t in req.tools])
        choice = choice_from_openai(raw.model_dump() if isinstance(raw, BaseModel) else raw, tools)
        parallel = req.parallel_tool_calls is not False
        fmt = detect(model.tokenizer.chat_template)
        return tool_calling(fmt, tools, choice, parallel, model)
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None


def rendered_messages(
    p: Prompting, req: ChatCompletionRequest, tools: ToolCalling | None
) -> Rendered:
    """The request's messages (and tools) as the model's chat template gets them (as they are
    when nothing in the request is about tools)."""
    messages = chat_messages(req)
    if tools is None and not uses_tools(messages):
        return Rendered.plain(messages)
    fmt = tools.fmt if tools is not None else detect(p.prompts.model.tokenizer.chat_template)
    try:
        return render(messages, fmt, tools.tools if tools is not None else ())
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None


def with_tools(call: EngineCall, tools: ToolCalling | None) -> EngineCall:
    """``call`` with its tools: their stop strings and, for a forced call, its grammar."""
    if tools is None:
        return call
    stop = call.params.stop
    if len(stop) + len(tools.stops) <= 16:  # else the parser alone keeps the first call
        stop += tools.stops
    params = replace(call.params, stop=stop, structure=tools.structure or call.params.structure)
    return replace(call, params=params, tools=tools)


def forced_prompt(p: Prompting, prompt: Prompt, tools: ToolCalling | None) -> Prompt:
    """``prompt`` ending with the forced call's opening (its last segment extended)."""
    text = tools.forced_text if tools is not None else ""
    if not text:
        return prompt
    ids = tuple(p.prompts.model.tokenizer.encode(text, add_special_tokens=False))
    last = prompt.segments[-1]
    if last.kind is SegmentKind.DOCUMENT:
        return replace(prompt, segments=prompt.segments + (Segment(SegmentKind.SUFFIX, ids),))
    return replace(prompt, segments=prompt.segments[:-1] + (Segment(last.kind, last.ids + ids),))


def requested_max_tokens(req: SamplingRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def sampling_params(
    req: SamplingRequest, prompt_tokens: int, limits: Limits, structure=None
) -> SamplingParams:
    """``SamplingParams`` for a prompt of ``prompt_tokens`` tokens, enforcing the server's limits;
    ``structure``: the compiled grammar of its structured-output field, if any."""
    max_tokens = max_tokens_for(req, prompt_tokens, limits)
    fields = sampling_fields(req, limits)
    try:
        return SamplingParams(max_tokens=max_tokens, structure=structure, **fields)
    except ValueError as e:  # SamplingParams names the field first: "stop must be ..."
        field_name = str(e).split(" ", 1)[0]
        raise bad_request(f"{e}", param=field_name) from None


def max_tokens_for(req: SamplingRequest, prompt_tokens: int, limits: Limits) -> int:
    """The request's max_tokens (or max_completion_tokens), or the default that fits; a 400 when
    it exceeds the server's limit or, with the prompt, the context window."""
    name = (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    room = limits.context_window - prompt_tokens
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if room < 1:
        raise bad_request(
            f"{prompt_param}: the prompt has {prompt_tokens} tokens; the model's context window is "
            f"{limits.context_window} tokens (prompt + max_tokens must fit); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        return min(limits.default_max_tokens, room)
    if max_tokens < 1 or max_tokens > limits.max_tokens_limit:
        raise bad_request(
            f"{name} must be between 1 and {limits.max_tokens_limit} (server.max_tokens_limit), "
            f"got {max_tokens}",
            param=name,
        )
    if max_tokens > room:
        raise bad_request(
            f"{prompt_param}: the prompt has {prompt_tokens} tokens and {name} is {max_tokens}: together more than the "
            f"model's context window of {limits.context_window} tokens; shorten the prompt or lower {name}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return max_tokens


def sampling_fields(req: SamplingRequest, limits: Limits) -> dict:
    """The request's sampling fields as ``SamplingParams`` takes them (their defaults filled in:
    OpenAI's temperature 1; top_k -1 is vLLM's "off", as 0)."""
    stop = req.stop if req.stop is not None else ()
    return dict(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        n=choices(req),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req.logit_bias, limits.vocab_size),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=known_ids(req.stop_token_ids or [], limits.vocab_size, "stop_token_ids"),
        ignore_eos=bool(req.ignore_eos),
        **logprob_fields(req),
    )


def choices(req: SamplingRequest) -> int:
    """``n``; on completions, ``best_of`` must equal it (every candidate is returned: ranking
    more candidates than are returned is not supported)."""
    n = req.n or 1
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request(
            f"best_of: only best_of equal to n ({n}) is supported, got {best_of}; "
            "ask for n choices instead",
            param="best_of",
        )
    return n


def logprob_fields(req: SamplingRequest) -> dict:
    """``logprobs`` / ``prompt_logprobs`` (alternatives per token, None: off) from chat's
    ``logprobs`` + ``top_logprobs``, or completions' ``logprobs`` (+ ``echo``: the prompt's)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs")
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    if isinstance(req, CompletionRequest):
        echo = bool(req.echo) and req.logprobs is not None
        return {"logprobs": req.logprobs, "prompt_logprobs": req.logprobs if echo else None}
    return {}


def logit_bias(bias: dict[str, float] | None, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as string keys) as ``(id, bias)`` pairs; a 400 for a
    key that is not a token id of the model, or a bias outside [-100, 100]."""
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        known_ids([token], vocab, "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias: values must be in [-100, 100], got {value} for token {token}",
                param="logit_bias",
            )
        out.append((token, float(value)))
    return tuple(out)


def known_ids(ids: list[int], vocab: int | None, param: str) -> tuple[int, ...]:
    """``ids``, each checked to be a token id of the model's vocabulary (a 400 naming
    ``param`` otherwise)."""
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            limit = f" (the vocabulary has {vocab} tokens)" if vocab is not None else ""
            raise bad_request(f"{param}: {t} is not a token id{limit}", param=param)
    return tuple(ids)


def recompute_ratio(p: Prompting, opts: KVFuseOptions) -> float | str | None:
    """The request's ``recompute_ratio`` (over the server's blend options), checked: it applies
    to prompts with documents or with automatic reuse."""
    if opts.documents is None:
        if opts.recompute_ratio is None:
            return None
        auto = opts.blend_auto == "on" if opts.blend_auto is not None else p.auto_reuse
        if not auto:
            raise bad_request(
                "recompute_ratio: applies to requests with documents or with automatic reuse "
                '(blend_auto: "on", or the server\'s blend.auto); add one or remove it',
                param="recompute_ratio",
            )
        return opts.recompute_ratio
    if not opts.cache:
        raise bad_request('documents: need the KV cache; remove "cache": false', param="documents")
    return opts.recompute_ratio


def _engine_call(
    req: SamplingRequest, prompt: Prompt, tenant: str, limits: Limits, p: Prompting
) -> EngineCall:
    return EngineCall(
        prompt,
        sampling_params(req, len(prompt), limits, structure(p, req)),
        cache_options(req, tenant),
        recompute_ratio(p, req),
    )


def structure(p: Prompting, req: SamplingRequest):
    """The compiled grammar of the request's structured-output field (``response_format`` or
    vLLM's ``guided_*``), or None; compiles (cached): call it off the event loop."""
    fmt = request_format(req)
    if fmt is None:
        return None
    if isinstance(req, ChatCompletionRequest):
        require_json_word(fmt, [m["content"] for m in chat_messages(req)], "messages")
    return compile_format(fmt, p.grammars or Grammars.default(p.prompts.model))


def _document_prompt(p: Prompting, req: SamplingRequest, **prompt) -> Prompt:
    try:
        return p.prompts.document_prompt(req.documents, **prompt)
    except ChatTemplateError as e:
        raise bad_request(
            f"messages: {e}", param="messages", code="invalid_chat_template"
        ) from None
    except ValueError as e:
        param = (
            "documents"
            if str(e).startswith(("document", "documents"))
            else ("messages" if "messages" in prompt else "prompt")
        )
        raise bad_request(f"{param}: {e}", param=param) from None


def plan_completion(
    p: Prompting, req: CompletionRequest, tenant: str, limits: Limits
) -> EngineCall:
    """Tokenize and check a completion request (runs the tokenizer: call it off the event loop)."""
    prompt = completion_prompt(req)
    if req.documents is not None:
        if not isinstance(prompt, str):
            raise bad_request(
                "documents: need a text prompt; token-id prompts cannot be combined with documents",
                param="documents",
            )
        return _engine_call(req, _document_prompt(p, req, prompt=prompt), tenant, limits, p)
    try:
        ids = p.prompts.encode_prompt(prompt)
    except ValueError as e:  # token ids outside the vocabulary
        raise bad_request(f"prompt: {e}", param="prompt") from None
    if not ids:
        raise bad_request("prompt: the prompt is empty", param="prompt")
    return _engine_call(req, Prompt.plain(ids), tenant, limits, p)


def plan_chat(p: Prompting, req: ChatCompletionRequest, tenant: str, limits: Limits) -> EngineCall:
    """Render, tokenize and check a chat request (call it off the event loop)."""
    tools = request_tools(p, req)
    chat = rendered_messages(p, req, tools)
    if req.documents is not None:
        prompt = _document_prompt(p, req, messages=chat.messages, tools=chat.tools)
        call = _engine_call(req, forced_prompt(p, prompt, tools), tenant, limits, p)
        return with_tools(call, tools)
    try:
        # A conversation beyond the context window loses its oldest turns (cache.truncation).
        reserve = requested_max_tokens(req) or limits.default_max_tokens
        ids, dropped = p.prompts.encode_chat(
            chat.messages, reserve=min(reserve, limits.context_window - 1), tools=chat.tools
        )
    except ChatTemplateError as e:
        raise bad_request(
            f"messages: {e}", param="messages", code="invalid_chat_template"
        ) from None
    except ValueError as e:  # over server.max_chat_messages / max_chat_chars
        raise bad_request(f"messages: {e}", param="messages") from None
    if not ids:
        raise bad_request("messages: the rendered conversation is empty", param="messages")
    prompt = forced_prompt(p, Prompt.plain(ids), tools)
    call = with_tools(_engine_call(req, prompt, tenant, limits, p), tools)
    call = replace(call, dropped_messages=dropped)
    marks = chat_marks(req)
    if marks and dropped == 0 and call.cache.enabled:
        positions = p.prompts.breakpoint_positions(
            chat.messages, [chat.mark(m, c) for m, c, _ in marks], ids, chat.tools
        )
        points = tuple(
            sorted({Breakpoint(p, ttl) for p, (_, _, ttl) in zip(positions, marks) if p})
        )
        call = replace(call, cache=replace(call.cache, breakpoints=points))
    return call
