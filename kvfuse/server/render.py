"""``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``: vLLM's render
endpoints (``vllm/entrypoints/scale_out/render``), which answer what a generation request would
give the engine without running it: the prompt's token ids and the sampling parameters.

vllm-router's ``kv_aware`` policy asks a worker to render a chat before it hashes the prompt into
blocks (and falls back to ``/tokenize`` on an error); llm-d's token producer and RL rollout
frameworks call it too. The ids must therefore be exactly those ``/v1/chat/completions`` would
prefill, so the body goes through the same ``plan_chat`` / ``plan_completion`` (chat template,
tools, documents, truncation of a too-long conversation, every 400 of the generation routes).

The answer is vLLM's ``GenerateRequest``: ``token_ids``, ``sampling_params`` under vLLM's field
names (``vllm_sampling_params``), ``model``, ``stream``, ``cache_salt`` and vLLM's other fields
at their defaults. The body is kvfuse's strict request model, so an unknown field is a 400 naming
it. As on vLLM, the routes are under ``/v1`` and so need the API key when the server has keys;
unlike a generation they do not count against the tenant's rate limit (a router renders every
request it then forwards: counting both would halve the tenant's quota).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from kvfuse.generation import SamplingParams

from .completions import ERRORS
from .deps import current_tenant, get_state
from .request_log import record_of
from .schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from .structured import OutputFormat, request_format
from .translate import EngineCall, check_model, plan_chat, plan_completion

router = APIRouter(tags=["workers"])


class RenderedRequest(BaseModel):
    """vLLM's ``GenerateRequest``, as its render endpoints answer it (field for field)."""

    request_id: str = Field(..., description="`chatcmpl-<id>` or `cmpl-<id>` (x-request-id's id).")
    token_ids: list[int] = Field(..., description="The prompt's ids, as the generation prefills.")
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: dict[str, Any] = Field(..., description="`vllm_sampling_params`.")
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


def structured_outputs(fmt: OutputFormat) -> dict[str, Any]:
    """A structured-output field as vLLM's ``StructuredOutputsParams`` names it."""
    if fmt.kind == "json_schema":
        return {"json": fmt.schema}
    if fmt.kind == "regex":
        return {"regex": fmt.pattern}
    if fmt.kind == "choice":
        return {"choice": list(fmt.choices)}
    return {"json_object": True}


def vllm_sampling_params(params: SamplingParams, fmt: OutputFormat | None = None) -> dict:
    """``params`` as vLLM's ``SamplingParams`` serializes (msgspec, defaults omitted): the
    values kvfuse applies, the unset optional ones (``seed``, ``logprobs``, ``prompt_logprobs``,
    ``logit_bias``, ``structured_outputs``) left out. ``stop`` includes the stop strings a
    request's tools add."""
    out: dict[str, Any] = {
        "n": params.n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
    }
    optional = {
        "seed": params.seed,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "logit_bias": {str(t): b for t, b in params.logit_bias} or None,
        "structured_outputs": structured_outputs(fmt) if fmt is not None else None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def rendered(request_id: str, call: EngineCall, body, fmt: OutputFormat | None) -> RenderedRequest:
    """The render answer for ``body`` planned as ``call``."""
    return RenderedRequest(
        request_id=request_id,
        token_ids=list(call.prompt_ids),
        sampling_params=vllm_sampling_params(call.params, fmt),
        model=body.model,
        stream=bool(body.stream),
        stream_options=body.stream_options if body.stream else None,
        cache_salt=body.cache_salt,
    )


async def _render(request: Request, body, tenant: str, chat: bool) -> RenderedRequest:
    state = get_state(request)
    check_model(body.model, state.model_name)
    plan = plan_chat if chat else plan_completion
    call = await asyncio.to_thread(plan, state.prompting, body, tenant, state.limits)
    record = record_of(request)
    if record is not None:
        record.model, record.prompt_tokens = body.model, len(call.prompt)
    suffix = record.request_id.removeprefix("req_") if record is not None else uuid.uuid4().hex
    prefix = "chatcmpl" if chat else "cmpl"
    return rendered(f"{prefix}-{suffix}", call, body, request_format(body))


@router.post(
    "/v1/chat/completions/render", response_model=RenderedRequest, responses=ERRORS,
    summary="The token ids and sampling parameters of a chat completion (vLLM's endpoint)",
)  # fmt: skip
async def render_chat_completion(
    body: ChatCompletionRequest, request: Request, tenant: str = Depends(current_tenant)
) -> RenderedRequest:
    return await _render(request, body, tenant, chat=True)


@router.post(
    "/v1/completions/render", response_model=list[RenderedRequest], responses=ERRORS,
    summary="The token ids and sampling parameters of a completion (vLLM's endpoint)",
)  # fmt: skip
async def render_completion(
    body: CompletionRequest, request: Request, tenant: str = Depends(current_tenant)
) -> list[RenderedRequest]:
    return [await _render(request, body, tenant, chat=False)]
