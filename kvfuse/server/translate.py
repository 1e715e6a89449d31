"""Request bodies -> one engine call: the prompt (token ids, or segments with ``documents``),
``SamplingParams``, ``CacheOptions`` and the blend options.

Everything a request can get wrong is found here, before the request is queued, so that a
streaming response never has to report a bad request after its 200 went out. Every failure is an
``APIError`` (400 naming the field) and the functions other than ``plan_*`` are pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvfuse.durations import parse_duration
from kvfuse.engine import Breakpoint, CacheOptions, Outcome, Prompt, Request, Retention
from kvfuse.generation import SamplingParams
from kvfuse.models.tokenizer import ChatTemplateError
from kvfuse.prompts import PromptBuilder

from .errors import APIError, bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, KVFuseOptions, SamplingRequest


@dataclass(frozen=True)
class EngineCall:
    """What one HTTP request asks the engine for."""

    prompt: Prompt
    params: SamplingParams
    cache: CacheOptions
    # the request's recompute budget over the engine's blend options (None: the engine's)
    recompute_ratio: float | str | None = None
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
    ) -> Request:
        """The engine request (its callbacks run on the engine thread)."""
        return Request(
            self.prompt,
            self.params,
            self.cache,
            recompute_ratio=self.recompute_ratio,
            request_id=request_id,
            on_text=on_text,
            on_done=on_done,
        )


@dataclass(frozen=True)
class Prompting:
    """What translating a request needs of the running server: its prompt builder (shared with
    the engine: ``runtime.open_serving``) and whether plain prompts look for cached passages
    unless a request says otherwise (``blend.auto``)."""

    prompts: PromptBuilder
    auto_reuse: bool = False


@dataclass(frozen=True)
class Limits:
    """What the configuration and the model allow."""

    max_tokens_limit: int
    default_max_tokens: int
    context_window: int


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


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template expects them: role and content strings."""
    out = []
    for m in req.messages:
        if isinstance(m.content, list):
            content = "\n".join(part.text for part in m.content)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
        msg = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def requested_max_tokens(req: SamplingRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def sampling_params(req: SamplingRequest, prompt_tokens: int, limits: Limits) -> SamplingParams:
    """``SamplingParams`` for a prompt of ``prompt_tokens`` tokens, enforcing the server's limits."""
    name = (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    if req.n not in (None, 1):
        raise bad_request(
            f"n: only n=1 is supported, got {req.n}; send several requests instead", param="n"
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
        max_tokens = min(limits.default_max_tokens, room)
    elif max_tokens < 1 or max_tokens > limits.max_tokens_limit:
        raise bad_request(
            f"{name} must be between 1 and {limits.max_tokens_limit} (server.max_tokens_limit), "
            f"got {max_tokens}",
            param=name,
        )
    elif max_tokens > room:
        raise bad_request(
            f"{prompt_param}: the prompt has {prompt_tokens} tokens and {name} is {max_tokens}: together more than the "
            f"model's context window of {limits.context_window} tokens; shorten the prompt or lower {name}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    stop = req.stop if req.stop is not None else ()
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=req.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=bool(req.ignore_eos),
        )
    except ValueError as e:  # SamplingParams names the field first: "stop must be ..."
        field_name = str(e).split(" ", 1)[0]
        raise bad_request(f"{e}", param=field_name) from None


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
        sampling_params(req, len(prompt), limits),
        cache_options(req, tenant),
        recompute_ratio(p, req),
    )


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
    if req.documents is not None:
        return _engine_call(
            req, _document_prompt(p, req, messages=chat_messages(req)), tenant, limits, p
        )
    try:
        # A conversation beyond the context window loses its oldest turns (cache.truncation).
        reserve = requested_max_tokens(req) or limits.default_max_tokens
        ids, dropped = p.prompts.encode_chat(
            chat_messages(req), reserve=min(reserve, limits.context_window - 1)
        )
    except ChatTemplateError as e:
        raise bad_request(
            f"messages: {e}", param="messages", code="invalid_chat_template"
        ) from None
    except ValueError as e:  # over server.max_chat_messages / max_chat_chars
        raise bad_request(f"messages: {e}", param="messages") from None
    if not ids:
        raise bad_request("messages: the rendered conversation is empty", param="messages")
    call = replace(
        _engine_call(req, Prompt.plain(ids), tenant, limits, p), dropped_messages=dropped
    )
    marks = chat_marks(req)
    if marks and dropped == 0 and call.cache.enabled:
        positions = p.prompts.breakpoint_positions(
            chat_messages(req), [(m, c) for m, c, _ in marks], ids
        )
        points = tuple(
            sorted({Breakpoint(p, ttl) for p, (_, _, ttl) in zip(positions, marks) if p})
        )
        call = replace(call, cache=replace(call.cache, breakpoints=points))
    return call
