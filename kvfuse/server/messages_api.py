"""Anthropic's Messages API: POST /v1/messages (JSON or Anthropic's event stream) and POST
/v1/messages/count_tokens.

A request is translated (``anthropic_translate.plan_messages``: rendered, tokenized, checked;
every 4xx happens there, before anything is queued) into an engine request, submitted to the
engine's queue, then awaited (a ``message`` body) or relayed as Anthropic's events
(``anthropic_bodies``). A streamed request asks the engine for ``on_start``, so that
``message_start`` carries the prompt's real usage (read from and written to the cache) once it
is prefilled. The caller's tenant comes from ``x-api-key`` (or ``Authorization: Bearer``),
mapped as on the OpenAI routes; ``anthropic-version`` and ``anthropic-beta`` are accepted (any
value); errors have Anthropic's shape (``errors.error_response``), a full queue is Anthropic's
529 ``overloaded_error``. A client that disconnects withdraws its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfuse.engine import Outcome
from kvfuse.engine import Request as EngineRequest

from .anthropic_bodies import MessageBuilder
from .anthropic_errors import OVERLOADED
from .anthropic_schemas import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from .anthropic_translate import count_tokens, plan_messages
from .completions import outcome_result, submit, watch_disconnect
from .deps import anthropic_limited_tenant, get_state
from .errors import APIError
from .events import RequestEvents, Started
from .request_log import RECORD_KEY, RequestRecord
from .state import ServerState
from .translate import check_model

router = APIRouter(tags=["messages"])

ERRORS = {
    400: {
        "model": AnthropicErrorResponse,
        "description": "invalid_request_error: malformed JSON, an unknown or unsupported field "
        "(named), an unsupported content block (image, document, ...), a prompt too long for "
        "the context window.",
    },
    401: {
        "model": AnthropicErrorResponse,
        "description": "authentication_error: missing or wrong key.",
    },
    404: {"model": AnthropicErrorResponse, "description": "not_found_error: an unknown model."},
    413: {
        "model": AnthropicErrorResponse,
        "description": "request_too_large: server.max_body_bytes.",
    },
    429: {
        "model": AnthropicErrorResponse,
        "description": "rate_limit_error: the tenant's requests per minute are spent.",
    },
    529: {
        "model": AnthropicErrorResponse,
        "description": "overloaded_error: the request queue is full (server.max_queue).",
    },
}
_SSE = {
    "text/event-stream": {
        "schema": {"type": "string"},
        "example": 'event: message_start\ndata: {"type": "message_start", ...}\n\n',
    }
}
_VERSION = Header(
    None,
    alias="anthropic-version",
    description="Anthropic's API version header: accepted, whatever its value.",
)


def _message_id(request_id: str) -> str:
    return f"msg_{request_id.removeprefix('req_')}"


@router.post(
    "/v1/messages",
    response_model=MessageResponse,
    summary="Create a message",
    responses={
        200: {"content": _SSE, "description": "The message, or with stream=true its events."},
        **ERRORS,
    },
    description="Anthropic's Messages API. Text content blocks, system prompts, stop "
    "sequences, sampling, tool use (custom tools, tool_choice, tool_use / tool_result blocks) "
    "and cache_control breakpoints (5m / 1h) are supported; usage splits "
    "the prompt into cache_read_input_tokens, cache_creation_input_tokens and input_tokens.",
)
async def create_message(
    body: MessagesRequest,
    request: Request,
    tenant: str = Depends(anthropic_limited_tenant),
    anthropic_version: str | None = _VERSION,
) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    record: RequestRecord = request.scope[RECORD_KEY]
    record.model, record.stream = body.model, body.stream
    check_model(body.model, state.model_name)
    # Rendering the chat template and tokenizing can take a while for a long prompt: not on the loop.
    plan = await asyncio.to_thread(plan_messages, state.prompting, body, tenant, state.limits)
    record.prompt_tokens = len(plan.call.prompt)
    events = RequestEvents()

    def on_done(outcome: Outcome) -> None:  # engine thread (or the loop, for a withdrawn request)
        state.metrics.observe_outcome(outcome)
        events.on_done(outcome)

    job = plan.call.request(
        record.request_id, on_text=events.on_text if body.stream else None, on_done=on_done
    )
    if body.stream:
        job.on_start = events.on_start
    await _submit(state, job)
    watcher = asyncio.create_task(watch_disconnect(request, lambda: state.engine.withdraw(job)))
    builder = MessageBuilder(
        _message_id(record.request_id),
        state.model_name,
        plan.max_tokens,
        plan.breakpoints,
        plan.call.tools,
        plan.stop_sequences,
    )
    headers = {"request-id": record.request_id}
    if body.stream:
        return StreamingResponse(
            _stream(state, record, job, events, watcher, builder),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    try:
        outcome = await events.outcome()
    except BaseException:  # this task was cancelled (e.g. at shutdown): stop the work too
        state.engine.withdraw(job)
        raise
    finally:
        watcher.cancel()
    return JSONResponse(builder.body(outcome_result(outcome, record)), headers=headers)


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    summary="Count the tokens of a message request",
    responses=ERRORS,
    description="The prompt's token count as POST /v1/messages would render it.",
)
async def count_message_tokens(
    body: CountTokensRequest,
    request: Request,
    tenant: str = Depends(anthropic_limited_tenant),
    anthropic_version: str | None = _VERSION,
) -> JSONResponse:
    state = get_state(request)
    record: RequestRecord = request.scope[RECORD_KEY]
    record.model = body.model
    check_model(body.model, state.model_name)
    n = await asyncio.to_thread(count_tokens, state.prompting, body)
    record.prompt_tokens = n
    return JSONResponse({"input_tokens": n}, headers={"request-id": record.request_id})


async def _submit(state: ServerState, job: EngineRequest) -> None:
    """``completions.submit``, with a full queue answered as Anthropic's overload (529)."""
    try:
        await submit(state, job)
    except APIError as e:
        if e.code != "queue_full":
            raise
        raise APIError(
            OVERLOADED, f"Overloaded: {e.message}", code="overloaded", headers=e.headers
        ) from None


async def _stream(
    state: ServerState,
    record: RequestRecord,
    job: EngineRequest,
    events: RequestEvents,
    watcher: asyncio.Task,
    builder: MessageBuilder,
) -> AsyncIterator[str]:
    finished = False
    try:
        while not isinstance(item := await events.next(), Outcome):
            pieces = builder.start(item.result) if isinstance(item, Started) else builder.text(item)
            for event in pieces:
                yield event
        finished = True
        try:
            result = outcome_result(item, record)
        except APIError as e:
            yield builder.error(e.status, e.message, record.request_id)
            return
        for event in builder.finish(result):
            yield event
    finally:
        watcher.cancel()
        if not finished:  # the client went away (the response task was cancelled): stop the work
            state.engine.withdraw(job)
            record.finish_reason, record.error = "cancelled", "client_disconnected"
