"""POST /v1/completions and POST /v1/chat/completions, streaming and not.

A request is translated (tokenized and checked: any 4xx happens here) into an engine request,
submitted to the engine's queue, and then either awaited (JSON body) or relayed chunk by chunk
(server-sent events). A client that disconnects withdraws its request: a waiting one is dropped,
a running one stops at the engine's next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfuse.engine import (
    Delta,
    Outcome,
    QueueClosed,
    QueueFull,
    RequestCancelled,
)
from kvfuse.engine import (
    Request as EngineRequest,
)

from .bodies import SSE_DONE, Rendering, ResponseBuilder, sse_event
from .deps import get_state, limited_tenant
from .disclosure import exact_for, reported
from .errors import APIError, internal_error
from .events import RequestEvents
from .request_log import RECORD_KEY, RequestRecord
from .schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from .state import ServerState
from .translate import EngineCall, check_model, completion_prompt, plan_chat, plan_completion

router = APIRouter(tags=["generation"])

ERRORS = {
    400: {
        "model": ErrorResponse,
        "description": "Invalid request: malformed JSON, a field of the wrong type or "
        "value, a prompt too long for the context window.",
    },
    401: {
        "model": ErrorResponse,
        "description": "Missing or wrong API key (only when the server has API keys).",
    },
    404: {"model": ErrorResponse, "description": "Unknown model (code model_not_found)."},
    413: {"model": ErrorResponse, "description": "Request body larger than server.max_body_bytes."},
    429: {
        "model": ErrorResponse,
        "description": "The request queue is full (server.max_queue, code queue_full), or "
        "the tenant's requests per minute are spent (its quota, code "
        "rate_limit_exceeded, with Retry-After); retry later.",
    },
}
_SSE = {
    "text/event-stream": {
        "schema": {"type": "string"},
        "example": 'data: {"id": "...", "choices": [...]}\n\ndata: [DONE]\n\n',
    }
}


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    summary="Create a completion",
    responses={
        200: {
            "content": _SSE,
            "description": "The completion, or with stream=true an event stream of chunks.",
        },
        **ERRORS,
    },
    description="OpenAI-compatible text completion. `usage.prompt_tokens_details.cached_tokens` counts the prompt "
    "tokens whose KV was reused from the cache. kvfuse extension fields: `cache_salt`, `cache`, "
    "`documents`, `recompute_ratio`, `blend_auto`, `kv_slo_ms`.",
)
async def create_completion(
    body: CompletionRequest, request: Request, tenant: str = Depends(limited_tenant)
) -> JSONResponse | StreamingResponse:
    return await _generate(request, body, tenant, chat=False)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    summary="Create a chat completion",
    responses={
        200: {
            "content": _SSE,
            "description": "The reply, or with stream=true an event stream of chunks.",
        },
        **ERRORS,
    },
    description="OpenAI-compatible chat completion; the messages are rendered with the model's chat template. "
    "kvfuse extension fields: `cache_salt`, `cache`, `documents`, `recompute_ratio`, `blend_auto`, "
    "`kv_slo_ms`.",
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, tenant: str = Depends(limited_tenant)
) -> JSONResponse | StreamingResponse:
    return await _generate(request, body, tenant, chat=True)


async def _generate(request: Request, body, tenant: str, chat: bool):
    state = get_state(request)
    record: RequestRecord = request.scope[RECORD_KEY]
    record.model, record.stream = body.model, bool(body.stream)
    check_model(body.model, state.model_name)
    plan = plan_chat if chat else plan_completion
    # Tokenizing (and rendering the chat template) can take a while for a long prompt: not on the loop.
    call = await asyncio.to_thread(plan, state.prompting, body, tenant, state.limits)
    record.prompt_tokens = len(call.prompt)

    events = RequestEvents()
    exact = exact_for(body, state.config.server.cached_tokens)

    def on_done(outcome: Outcome) -> None:  # engine thread (or the loop, for a withdrawn request)
        state.metrics.observe_outcome(outcome)
        events.on_done(reported(outcome, exact, state.config.cache.chunk_size))

    job = call.request(
        record.request_id, on_delta=events.on_delta if body.stream else None, on_done=on_done
    )
    await submit(state, job)
    watcher = asyncio.create_task(watch_disconnect(request, lambda: state.engine.withdraw(job)))

    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    builder = ResponseBuilder(
        record.request_id,
        state.model_name,
        int(time.time()),
        chat,
        include_usage,
        rendering(state, body, call),
        call.tools,
    )
    if body.stream:
        return StreamingResponse(
            _stream(state, record, job, events, watcher, builder),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    try:
        outcome = await awaited(events, state.config.server.request_timeout_s)
    except BaseException:  # timed out, or this task was cancelled (at shutdown): stop the work
        state.engine.withdraw(job)
        raise
    finally:
        watcher.cancel()
    return JSONResponse(builder.body(outcome_result(outcome, record)))


def rendering(state: ServerState, body, call: EngineCall) -> Rendering:
    """What the response bodies carry besides the text: the choices, logprobs, and a
    completion's echoed prompt (the prompt string as sent; else the prompt's ids decoded)."""
    p = call.params
    echo = None
    if getattr(body, "echo", False):
        prompt = completion_prompt(body)
        if isinstance(prompt, str) and body.documents is None:
            echo = prompt
        else:
            echo = state.token_texts.tokenizer.decode(call.prompt_ids, skip_special_tokens=False)
    return Rendering(
        n=p.n,
        logprobs=p.logprobs is not None,
        echo=echo,
        prompt_ids=tuple(call.prompt_ids) if echo is not None else (),
        texts=state.token_texts if p.logprobs is not None else None,
    )


async def awaited(events: RequestEvents, timeout_s: float) -> Outcome:
    """A non-streaming request's outcome, or a 504 once ``timeout_s`` (server.request_timeout_s;
    0: none) have passed: a request the engine cannot finish (a wedge, a queue that never moves)
    must not hold its client and connection for ever. The caller withdraws the work."""
    if timeout_s <= 0:
        return await events.outcome()
    try:
        return await asyncio.wait_for(events.outcome(), timeout_s)
    except TimeoutError:
        raise APIError(
            504,
            f"the request was not answered within server.request_timeout_s ({timeout_s:g} s); "
            "it was withdrawn",
            code="request_timeout",
        ) from None


async def submit(state: ServerState, job: EngineRequest) -> None:
    """Queue ``job`` on the engine; the APIError to answer when it cannot be (429, 503, 400)."""
    try:
        # Submitting lines the prompt up with stored histories and hashes its keys: not on the loop.
        await asyncio.to_thread(state.engine.submit, job)
    except QueueFull as e:
        state.metrics.rejected.inc()
        raise APIError(
            429,
            f"the server is busy: {e}; retry later",
            code="queue_full",
            headers={"retry-after": "1"},
        ) from None
    except QueueClosed:
        raise APIError(503, "the server is shutting down", code="server_shutting_down") from None
    # a request that can never run here (e.g. larger than the whole KV budget)
    except ValueError as e:
        raise APIError(400, str(e), code="request_too_large") from None


async def _stream(
    state: ServerState,
    record: RequestRecord,
    job: EngineRequest,
    events: RequestEvents,
    watcher: asyncio.Task,
    builder: ResponseBuilder,
) -> AsyncIterator[str]:
    finished = False
    try:
        for chunk in builder.first_chunks():
            yield sse_event(chunk)
        while isinstance(item := await events.next(), Delta):
            for chunk in builder.delta_chunks(item):
                yield sse_event(chunk)
        finished = True
        try:
            result = outcome_result(item, record)
        except APIError as e:
            yield sse_event(e.body())
            return
        for chunk in builder.final_chunks(result):
            yield sse_event(chunk)
        yield SSE_DONE
    finally:
        watcher.cancel()
        if not finished:  # the client went away (the response task was cancelled): stop the work
            state.engine.withdraw(job)
            record.finish_reason, record.error = "cancelled", "client_disconnected"


def outcome_result(outcome: Outcome, record: RequestRecord):
    """The GenerationResult of ``outcome`` (noted in the log record), or the APIError to answer."""
    if outcome.error is not None:
        e = outcome.error
        if isinstance(e, RequestCancelled):
            record.error = "cancelled"
            raise APIError(503, f"the request was cancelled: {e}", code="cancelled")
        if isinstance(e, ValueError):
            record.error = "invalid_request"
            raise APIError(400, str(e), code="invalid_value")
        record.error = "internal_error"
        raise internal_error()
    result = outcome.result
    t = result.timings
    record.prompt_tokens, record.cached_tokens = result.prompt_tokens, result.cached_tokens
    record.completion_tokens, record.finish_reason = result.completion_tokens, result.finish_reason
    record.ttft_ms = round((t.queued_s + t.ttft_s) * 1000, 1)
    record.queue_ms = round(t.queued_s * 1000, 1)
    if result.finish_reason == "cancelled":
        record.error = "cancelled"
        raise APIError(503, "the request was cancelled before it finished", code="cancelled")
    return result


async def watch_disconnect(request: Request, on_disconnect) -> None:
    """Call ``on_disconnect`` when the client closes the connection (the body is already read, so
    the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
