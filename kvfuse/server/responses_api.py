"""OpenAI's Responses API: POST /v1/responses (JSON or events), GET / DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

A request is a chat completion of ``[instructions] + the previous response's history + input``:
``chat_request`` (pure) builds that chat request and ``translate.plan_chat`` plans it, so every 4xx
(context window, chat template, breakpoints, retention) is found the same way, with the field
names mapped back (``messages`` -> ``input``, ``max_completion_tokens`` -> ``max_output_tokens``).
``previous_response_id`` is resolved from the ``ResponseStore`` (the caller's tenant only: another
tenant's id is a 404, like an unknown one) and its KV history record goes to the engine as a hint
(``CacheOptions.history_hint``): the follow-up is lined up with the exact ids whose KV is stored
and reuses it, which ``usage.input_tokens_details.cached_tokens`` reports. A response with
``store`` (the default) is kept with its history and record when it completes; deleting it (or its
expiry) frees the entries no other stored response refers to.

Streaming sends OpenAI's event sequence, each as ``event: <type>`` + ``data: <json>``:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete at max_output_tokens).
An error after the stream started is an ``error`` event followed by response.failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvfuse.engine import Delta, GenerationResult, Outcome
from kvfuse.history.records import RecordRefused, decode_record, encode_record
from kvfuse.history.response_store import (
    ResponseExpired,
    ResponseNotFound,
    ResponseRefused,
    StoredResponse,
    over_limits,
    stored_size,
)
from kvfuse.prompts.truncate import without_oldest
from kvfuse.tools import ToolCalling

from .bodies import usage as chat_usage
from .completions import ERRORS, awaited, outcome_result, submit, watch_disconnect
from .deps import get_state, limited_tenant
from .disclosure import exact_for, reported
from .errors import APIError, bad_request
from .events import RequestEvents
from .logprobs import TokenTexts, chat_content
from .request_log import RECORD_KEY, RequestRecord
from .responses_tools import OutputItems, call_item, call_output_item, tool_fields
from .schemas import ChatCompletionRequest, ResponseCreateRequest
from .state import ServerState
from .structured import OutputFormat, as_response_format, responses_format
from .translate import check_model, plan_chat

log = logging.getLogger(__name__)

router = APIRouter(tags=["responses"])

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ------------------------------------------------------------------------------ pure translation


def input_messages(
    value: str | list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chat messages of a Responses ``input`` (content parts as chat ``text`` parts, with their
    cache breakpoints; ``function_call`` items as an assistant's ``tool_calls``,
    ``function_call_output`` items as ``tool`` messages) and the input items as they are stored
    and listed (each with an id). A 400 naming the item for anything else."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input: the input is empty", param="input")
        value = [{"role": "user", "content": value}]
    if not value:
        raise bad_request("input: give at least one message", param="input")
    messages, items = [], []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "function_call":
            call, stored = call_item(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            message, stored = call_output_item(item, where)
            messages.append(message)
        elif kind == "message":
            message, stored = _message(item, where)
            messages.append(message)
        else:
            raise bad_request(
                f"{where}: items of type {kind!r} are not supported; send messages "
                '({"role": ..., "content": ...}), function_call or function_call_output items',
                param="input",
            )
        items.append(stored)
    return messages, items


def _message(item: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A message input item: the chat message and the stored item."""
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}", param="input"
        )
    content = item.get("content")
    parts: list[dict[str, Any]] = []
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list) and content:
        parts = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise bad_request(
            f"{where}.content: must be a string or a non-empty list of text parts",
            param="input",
        )
    message: dict[str, Any] = {"role": role, "content": parts}
    if item.get("cache_control"):
        message["cache_control"] = item["cache_control"]
    part_type = "output_text" if role == "assistant" else "input_text"
    stored = {
        "id": _new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": part_type, "text": p["text"]} for p in parts],
    }
    return message, stored


def _part(part: Any, where: str) -> dict[str, Any]:
    """A text content part as a chat ``text`` part (with its cache breakpoint)."""
    if (
        not isinstance(part, dict)
        or part.get("type") not in _TEXT_PARTS
        or not isinstance(part.get("text"), str)
    ):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise bad_request(
            f"{where}: only text parts (input_text, output_text) are supported, got {kind!r}",
            param="input",
        )
    marks = {k: part[k] for k in ("cache_control", "prompt_cache_breakpoint") if part.get(k)}
    return {"type": "text", "text": part["text"], **marks}


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a stored history keeps them: role and content text (parts joined as a chat
    request joins them), an assistant's calls and a result's call id; no breakpoints (they
    belong to the request that set them)."""
    out = []
    for m in messages:
        content = m["content"] or ""
        text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
        plain = {"role": m["role"], "content": text}
        plain.update({k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k)})
        out.append(plain)
    return out


LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(body: ResponseCreateRequest) -> bool:
    """Whether output logprobs are asked: ``include`` names them, or ``top_logprobs`` is set
    (never dropped). A 400 naming ``include`` for anything else it lists."""
    for item in body.include or []:
        if item != LOGPROBS:
            raise bad_request(
                f"include: {item!r} is not supported; only {LOGPROBS!r} is", param="include"
            )
    return LOGPROBS in (body.include or []) or body.top_logprobs is not None


def kept_history(body, previous, messages: list[dict[str, Any]], call) -> list[dict[str, Any]]:
    """``conversation_kept`` of a request (``body``), the stored response it continues (or
    None), its input ``messages`` and its planned ``call`` (the messages it dropped)."""
    history = previous.history if previous is not None else []
    return conversation_kept(body.instructions, history, messages, call.dropped_messages)


def conversation_kept(
    instructions: str | None,
    history: list[dict[str, Any]],
    messages: list[dict[str, Any]],
    dropped: int,
) -> list[dict[str, Any]]:
    """The conversation a stored response keeps (before its answer): what its prompt kept. The
    turns dropped to fit the context window (``dropped``, of ``[instructions] + history +
    messages``) are not stored again, so chaining responses with large throw-away inputs does
    not store them once per later turn; ``instructions`` are not carried over (as OpenAI)."""
    head = [{"role": "system", "content": instructions}] if instructions is not None else []
    kept = without_oldest(head + history + plain_messages(messages), dropped)
    return kept[len(head) :]


def chat_request(
    body: ResponseCreateRequest,
    history: list[dict[str, Any]],
    messages: list[dict[str, Any]],
    fmt: OutputFormat | None = None,
) -> ChatCompletionRequest:
    """The chat completion request a Responses request stands for (``fmt``: its ``text.format``,
    as ``response_format``)."""
    conversation = (
        (
            [{"role": "system", "content": body.instructions}]
            if body.instructions is not None
            else []
        )
        + history
        + messages
    )
    fields = dict(
        model=body.model,
        messages=conversation,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stream=False,
        ignore_eos=body.ignore_eos,
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention,
        prompt_cache_options=body.prompt_cache_options,
        cache_salt=body.cache_salt,
        cache=body.cache,
        kv_slo_ms=body.kv_slo_ms,
        blend_auto=body.blend_auto,
        logprobs=wants_logprobs(body),
        top_logprobs=body.top_logprobs if wants_logprobs(body) else None,
        response_format=as_response_format(fmt),
        **tool_fields(body.tools, body.tool_choice, body.parallel_tool_calls),
        user=body.user,
    )
    try:
        return ChatCompletionRequest.model_validate(
            {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in fields.items()}
        )
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        loc = loc.replace("messages", "input", 1)
        param = loc.split(".")[0] if loc.startswith(("tools", "tool_choice")) else "input"
        raise bad_request(f"{loc}: {err['msg']}", param=param) from None


def usage(result: GenerationResult) -> dict[str, Any]:
    """The Responses API's usage (input/output tokens, cached and written input tokens), with
    kvfuse's details of where the reused KV came from."""
    details = chat_usage(result)["prompt_tokens_details"]
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {**details, "cache_write_tokens": result.written_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


class ResponseObject:
    """The response object of one request, as it changes: in progress, then completed/incomplete."""

    def __init__(
        self,
        body: ResponseCreateRequest,
        model: str,
        previous_id: str | None,
        clock=time.time,
        texts: TokenTexts | None = None,
        fmt: OutputFormat | None = None,
    ):
        self.texts = texts  # renders output logprobs (None: not asked)
        self.id = _new_id("resp")
        self.text_format = fmt.echo() if fmt is not None else {"type": "text"}
        self.message_id = _new_id("msg")
        self.clock = clock
        self.created_at = int(clock())
        self.body, self.model, self.previous_id = body, model, previous_id
        self.sequence = 0

    def object(
        self,
        status: str,
        result: GenerationResult | None = None,
        output: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The response object; ``output``: its items (``OutputItems``), once it has them."""
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(self.clock()) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": self.previous_id,
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "top_logprobs": b.top_logprobs,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "text": {"format": self.text_format},
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "prompt_cache_key": b.prompt_cache_key,
            "prompt_cache_retention": b.prompt_cache_retention,
            "user": b.user,
            "usage": usage(result) if result is not None else None,
        }

    def logprobs(self, entries) -> list[dict[str, Any]]:
        """Output logprobs in the Responses API's shape ([] when not asked)."""
        return chat_content(self.texts, entries or []) if self.texts is not None else []

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def items(self, tools: ToolCalling | None, stream: bool) -> OutputItems:
        """The builder of this response's output items (calls parsed with ``tools``, as they are
        generated when ``stream``; logprobs rendered when asked)."""
        parser = tools.parser(stream) if tools is not None else None
        lp = self.logprobs if self.texts is not None else None
        return OutputItems(self.event, parser, self.message_id, lp)


# ------------------------------------------------------------------------------------- handlers


def _with_hint(state: ServerState, call, previous: StoredResponse | None):
    """``call`` with the previous response's history record as its hint, when it has one that may
    be used. A damaged or refused one (unsigned or badly signed with signing on, or outside its
    scope: ``history.records``) is no hint, logged and counted: the history is still found by
    content, through its entries (signed, with signing on)."""
    if previous is None or previous.record is None or not call.cache.enabled:
        return call
    try:
        hint = decode_record(previous.record, state.record_signer)
    except ValueError as e:
        log.warning("response %s: its history record is not used (%s)", previous.id, e)
        if isinstance(e, RecordRefused):
            state.metrics.responses.labels(event="record_refused").inc()
        return call
    return replace(call, cache=replace(call.cache, history_hint=hint))


def _stored(state: ServerState, tenant: str, response_id: str) -> StoredResponse:
    """The tenant's stored response ``response_id`` (404 otherwise; an expired one is freed)."""
    if state.responses is None:
        raise APIError(
            404,
            f"response {response_id!r} not found: this server stores no responses "
            "(responses.store is false)",
            param="response_id",
            code="not_found",
        )
    try:
        return state.responses.get(tenant, response_id)
    except ResponseExpired as e:
        state.metrics.responses.labels(event="expired").inc()
        state.engine.free_entries(e.keys)
        raise APIError(
            404,
            f"response {response_id!r} has expired (responses.ttl) and was removed",
            param="response_id",
            code="response_expired",
        ) from None
    except ResponseNotFound:
        raise APIError(
            404, f"response {response_id!r} not found", param="response_id", code="not_found"
        ) from None


def _purge(state: ServerState) -> None:
    """Remove expired responses (at most once a minute) and free their entries."""
    if state.responses is None:
        return
    n, keys = state.responses.purge(force=False)
    if n:
        state.metrics.responses.labels(event="expired").inc(n)
        state.engine.free_entries(keys)


@router.post(
    "/v1/responses",
    summary="Create a response",
    response_model=None,
    responses={
        200: {"description": "The response object, or with stream=true its events."},
        **ERRORS,
    },
    description="OpenAI's Responses API (text). `previous_response_id` continues a stored response's conversation "
    "without sending it again, reusing its KV; `usage.input_tokens_details.cached_tokens` says how much. "
    "kvfuse extension fields: `cache_salt`, `cache`, `kv_slo_ms`, `blend_auto`, `seed`.",
)
async def create_response(
    body: ResponseCreateRequest, request: Request, tenant: str = Depends(limited_tenant)
) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    record: RequestRecord = request.scope[RECORD_KEY]
    record.model, record.stream = body.model, bool(body.stream)
    check_model(body.model, state.model_name)
    if body.documents is not None or body.recompute_ratio is not None:
        raise bad_request(
            "documents: not supported on /v1/responses; send documents to /v1/chat/completions",
            param="documents",
        )
    await asyncio.to_thread(_purge, state)
    previous = None
    if body.previous_response_id is not None:
        previous = await asyncio.to_thread(_stored, state, tenant, body.previous_response_id)
    messages, items = input_messages(body.input)
    fmt = responses_format(body.text)
    chat = chat_request(body, previous.history if previous is not None else [], messages, fmt)
    try:
        call = await asyncio.to_thread(plan_chat, state.prompting, chat, tenant, state.limits)
    except APIError as e:
        raise _renamed(e) from None
    call = _with_hint(state, call, previous)
    record.prompt_tokens = len(call.prompt)
    texts = state.token_texts if call.params.logprobs is not None else None
    obj = ResponseObject(body, state.model_name, body.previous_response_id, state.clock, texts, fmt)
    keep = _Keeper(state, tenant, obj, kept_history(body, previous, messages, call), items)
    await asyncio.to_thread(keep.check)  # a 413 before anything is generated
    events = RequestEvents()
    exact = exact_for(body, state.config.server.cached_tokens)

    def on_done(outcome: Outcome) -> None:
        state.metrics.observe_outcome(outcome)
        events.on_done(reported(outcome, exact, state.config.cache.chunk_size))

    job = call.request(
        record.request_id, on_delta=events.on_delta if body.stream else None, on_done=on_done
    )
    await submit(state, job)
    state.metrics.responses.labels(event="created").inc()
    if previous is not None:
        state.metrics.responses.labels(event="continued").inc()
    watcher = asyncio.create_task(watch_disconnect(request, lambda: state.engine.withdraw(job)))
    output = obj.items(call.tools, body.stream)
    if body.stream:
        return StreamingResponse(
            _stream(state, record, job, events, watcher, obj, keep, output),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    try:
        outcome = await awaited(events, state.config.server.request_timeout_s)
    except BaseException:
        state.engine.withdraw(job)
        raise
    finally:
        watcher.cancel()
    return JSONResponse(await _whole(outcome_result(outcome, record), obj, output, keep))


async def _whole(
    result: GenerationResult, obj: ResponseObject, output: OutputItems, keep: _Keeper
) -> dict[str, Any]:
    """The finished response object of a request answered whole (stored when asked to)."""
    status = _status(result)
    output.start()
    output.feed(result.text, result.choices[0].logprobs or [] if result.choices else [])
    output.finish(status)
    done = obj.object(status, result, output.items)
    await asyncio.to_thread(keep, done, result, output)
    return done


def _status(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _renamed(e: APIError) -> APIError:
    """A chat request's error in the Responses API's field names."""
    param = _PARAMS.get(e.param, e.param)
    message = e.message
    for old, new in _PARAMS.items():
        message = message.replace(old, new)
    return APIError(e.status, message, param=param, code=e.code, type=e.type, headers=e.headers)


class _Keeper:
    """Stores a finished response (when asked to) with the history its prompt kept and its KV
    record, within the store's limits (``StoreLimits``: a 413 beyond them)."""

    def __init__(
        self,
        state: ServerState,
        tenant: str,
        obj: ResponseObject,
        history: list[dict[str, Any]],
        items: list[dict[str, Any]],
    ):
        self.state, self.tenant, self.obj = state, tenant, obj
        self.history, self.items = history, items

    @property
    def storing(self) -> bool:
        return bool(self.obj.body.store) and self.state.responses is not None

    def check(self) -> None:
        """The 413 for a response that could not be stored, known before it is generated: its
        history and input items alone are too large, or its tenant is at its limits."""
        if not self.storing:
            return
        size = stored_size(StoredResponse("", self.tenant, 0, {}, self.history, self.items))
        why = over_limits(
            size, *self.state.responses.usage(self.tenant), self.state.response_limits
        )
        if why is not None:
            raise _too_large(why)

    def __call__(self, body: dict[str, Any], result: GenerationResult, output: OutputItems) -> None:
        """Store it; the 413 (APIError) when the store refuses it."""
        if not self.storing:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": output.text}
        if output.calls:
            answer["tool_calls"] = output.calls
        rec = result.history
        try:
            self.state.responses.put(
                StoredResponse(
                    self.obj.id,
                    self.tenant,
                    self.state.clock(),
                    body,
                    self.history + [answer],
                    self.items,
                    self.obj.previous_id,
                    encode_record(rec, self.state.record_signer) if rec is not None else None,
                    [str(e.key) for e in rec.entries] if rec is not None else [],
                ),
                self.state.response_limits,
            )
        except ResponseRefused as e:
            raise _too_large(str(e)) from None
        self.state.metrics.responses.labels(event="stored").inc()


def _too_large(why: str) -> APIError:
    return APIError(
        413,
        f"store: {why}; send store: false to get a response without storing it",
        param="store",
        code="response_store_limit",
    )


def _failure(obj: ResponseObject, e: APIError) -> list[str]:
    """The events of a stream that failed once it had started: an error, then response.failed."""
    failed = obj.object("failed")
    failed["error"] = {"code": e.code or "server_error", "message": e.message}
    return [
        obj.event("error", code=e.code, message=e.message, param=e.param),
        obj.event("response.failed", response=failed),
    ]


async def _stream(
    state: ServerState,
    record: RequestRecord,
    job,
    events: RequestEvents,
    watcher: asyncio.Task,
    obj: ResponseObject,
    keep: _Keeper,
    output: OutputItems,
) -> AsyncIterator[str]:
    finished = False
    try:
        yield obj.event("response.created", response=obj.object("in_progress"))
        yield obj.event("response.in_progress", response=obj.object("in_progress"))
        for event in output.start():
            yield event
        while isinstance(item := await events.next(), Delta):
            for event in output.feed(item.text, item.logprobs):
                yield event
        finished = True
        try:
            result = outcome_result(item, record)
        except APIError as e:
            for event in _failure(obj, e):
                yield event
            return
        status = _status(result)
        for event in output.finish(status):
            yield event
        done = obj.object(status, result, output.items)
        try:
            await asyncio.to_thread(keep, done, result, output)
        except APIError as e:
            for event in _failure(obj, e):
                yield event
            return
        yield obj.event(
            "response.completed" if status == "completed" else "response.incomplete", response=done
        )
    finally:
        watcher.cancel()
        if not finished:
            state.engine.withdraw(job)
            record.finish_reason, record.error = "cancelled", "client_disconnected"


_MAINTENANCE = (
    "Runs on the server's maintenance threads (kvfuse/server/maintenance.py), never those of "
    "generation requests: 429 beyond server.maintenance_per_tenant at once per tenant (or the "
    "tenant's requests_per_minute), 503 beyond server.maintenance_queue, 504 beyond "
    "server.maintenance_timeout_s."
)


@router.get(
    "/v1/responses/{response_id}",
    summary="Get a stored response",
    description=_MAINTENANCE,
    responses={
        404: ERRORS[404]
        | {"description": "No such response for this API key's tenant (or expired)."}
    },
)
async def get_response(
    response_id: str, request: Request, tenant: str = Depends(limited_tenant)
) -> JSONResponse:
    state = get_state(request)
    stored = await state.maintenance.run(tenant, _stored, state, tenant, response_id)
    return JSONResponse(stored.body)


@router.delete(
    "/v1/responses/{response_id}",
    summary="Delete a stored response and free its KV",
    description=_MAINTENANCE,
    responses={404: ERRORS[404] | {"description": "No such response for this API key's tenant."}},
)
async def delete_response(
    response_id: str, request: Request, tenant: str = Depends(limited_tenant)
) -> JSONResponse:
    state = get_state(request)
    flush_s = state.maintenance.timeout_s / 2

    def delete() -> dict[str, int]:
        if state.responses is None:
            raise ResponseNotFound(response_id)
        return state.engine.free_entries(state.responses.delete(tenant, response_id), flush_s)

    try:
        freed = await state.maintenance.run(tenant, delete)
    except ResponseNotFound:
        raise APIError(
            404, f"response {response_id!r} not found", param="response_id", code="not_found"
        ) from None
    state.metrics.responses.labels(event="deleted").inc()
    return JSONResponse(
        {"id": response_id, "object": "response", "deleted": True, "freed_entries": freed}
    )


@router.get(
    "/v1/responses/{response_id}/input_items",
    summary="List a stored response's input items",
    description=_MAINTENANCE,
)
async def list_input_items(
    response_id: str,
    request: Request,
    tenant: str = Depends(limited_tenant),
    limit: int = Query(20, ge=1, le=100),
    order: str = Query("desc", pattern="^(asc|desc)$"),
    after: str | None = Query(None),
) -> JSONResponse:
    state = get_state(request)
    stored = await state.maintenance.run(tenant, _stored, state, tenant, response_id)
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad_request(
                f"after: {after!r} is not an input item of response {response_id!r}", param="after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
