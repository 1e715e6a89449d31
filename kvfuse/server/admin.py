"""Everything but generation: models, health, Prometheus metrics, KV cache statistics and clearing."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from .deps import get_state, limited_tenant, metrics_access
from .errors import APIError
from .metrics import CONTENT_TYPE
from .schemas import NO_NUL, ErrorResponse, Health, KVDeleted, KVStats, ModelCard, ModelList

router = APIRouter()

_AUTH_ERRORS = {
    401: {
        "model": ErrorResponse,
        "description": "Missing or wrong API key (only when the server has keys).",
    },
    429: {
        "model": ErrorResponse,
        "description": "Over the tenant's requests_per_minute (every authenticated route counts).",
    },
}
_MAINTENANCE_ERRORS = {
    **_AUTH_ERRORS,
    429: {
        "model": ErrorResponse,
        "description": "Over the tenant's requests_per_minute, or the tenant already has "
        "server.maintenance_per_tenant maintenance requests running (Retry-After).",
    },
    503: {
        "model": ErrorResponse,
        "description": "server.maintenance_queue maintenance requests already run (Retry-After).",
    },
    504: {
        "model": ErrorResponse,
        "description": "Not done within server.maintenance_timeout_s (code maintenance_timeout); "
        "it goes on in the background and may be repeated.",
    },
}


@router.get(
    "/health",
    response_model=Health,
    tags=["operations"],
    summary="Liveness and queue state",
    response_class=JSONResponse,
    responses={503: {"model": Health, "description": "Starting, draining, or wedged."}},
    description="No API key needed. 200 while the server serves and its engine makes progress; "
    "503 while it starts (the engine not running yet) or drains (a SIGTERM received, or shutting "
    "down), so that routers' health checks take it out of rotation, and 503 (status wedged) when "
    "requests wait or run and no engine step did anything for server.stall_after_s.",
)
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    phase = state.phase
    q, engine = {}, {}
    if state.engine is not None:
        q = state.engine.queue_state()
        engine = state.engine.health(state.config.server.stall_after_s)
    status = phase if phase != "serving" else "ok"
    if status == "ok" and engine.get("wedged"):
        status = "wedged"
    body = Health(
        status=status,
        model=state.model_name if state.engine is not None else state.config.model,
        waiting=q.get("waiting", 0),
        running=q.get("running", 0),
        engine=engine,
    )
    return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503)


@router.get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}},
        401: {
            "model": ErrorResponse,
            "description": "Missing or wrong metrics token (only with server.metrics_token).",
        },
    },
    description="Prometheus text format. No API key: with `server.metrics_token` (or "
    "`server.metrics_token_file`) set, a bearer token of its own (401 without it); otherwise "
    "open, like /health. The metrics are server-wide counts (requests, tokens, cache tiers, "
    "latencies) and carry no content; per-tenant series (bytes held, quota evictions and "
    "rejections) appear for the tenants with a quota (`tenants:`): set a metrics token where "
    "tenants must not see each other's names.",
)
async def metrics(request: Request, _: None = Depends(metrics_access)) -> Response:
    state = get_state(request)
    body = await asyncio.to_thread(state.metrics.render)  # the store's tiers may be remote (Redis)
    return Response(body, media_type=CONTENT_TYPE)


@router.get(
    "/v1/models",
    response_model=ModelList,
    tags=["models"],
    summary="List the served model",
    responses=_AUTH_ERRORS,
    description="The one model this server serves; requests must name it in their `model` field.",
)
async def list_models(request: Request, tenant: str = Depends(limited_tenant)) -> ModelList:
    return ModelList(data=[_card(get_state(request))])


@router.get(
    "/v1/models/{model}",
    response_model=ModelCard,
    tags=["models"],
    summary="Describe a model",
    responses={
        **_AUTH_ERRORS,
        404: {"model": ErrorResponse, "description": "Not the served model."},
    },
    description="The served model's card; any other name is a 404 with code model_not_found.",
)
async def get_model(
    model: str, request: Request, tenant: str = Depends(limited_tenant)
) -> ModelCard:
    name = get_state(request).model_name
    if model != name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )
    return _card(get_state(request))


def _card(state) -> ModelCard:
    """The served model's card: ``owned_by`` from ``server.owned_by`` (docs/routers.md)."""
    name = state.model_name
    return ModelCard(
        id=name,
        owned_by=state.config.server.owned_by,
        root=name,
        max_model_len=state.engine.context_window,
    )


@router.get(
    "/v1/kv/stats",
    response_model=KVStats,
    tags=["kv cache"],
    summary="KV cache statistics",
    responses=_MAINTENANCE_ERRORS,
    description="Counters of every cache tier and of the engine (server-wide, not per tenant). "
    "Asked on the maintenance threads (the tiers may be remote: Redis), bounded like DELETE /v1/kv.",
)
async def kv_stats(request: Request, tenant: str = Depends(limited_tenant)) -> KVStats:
    state = get_state(request)
    engine = state.engine
    tiers = await state.maintenance.run(tenant, engine.cache_stats)
    return KVStats(
        cache_enabled=engine.cache_enabled,
        tiers=tiers,
        engine=engine.stats_snapshot(),
        queue=engine.queue_state(),
    )


@router.delete(
    "/v1/kv",
    response_model=KVDeleted,
    tags=["kv cache"],
    summary="Clear the caller's cached KV",
    responses={
        **_MAINTENANCE_ERRORS,
        202: {
            "model": KVDeleted,
            "description": "Deleted what was stored, but saves queued before the request were not "
            "all written in time (complete: false): repeat it to remove what lands later.",
        },
    },
    description="Deletes the cache entries of the caller's tenant from every tier (memory, disk, Redis): all of "
    "them, whatever model or cache_salt they were stored under, including entries written before "
    "the server restarted; with `cache_salt`, every entry stored under that salt: plain prompts, "
    "blended prompts (documents), conversations continued after dropped turns, for every model "
    "(each key carries the salt's tag after the tenant's). Other tenants' entries are never "
    "touched (every storage key starts with its tenant's 64-bit tag). Without API keys there is "
    "one anonymous tenant. Runs on the maintenance threads, never the generation requests': "
    "at most server.maintenance_per_tenant at once per tenant (429 beyond) and "
    "server.maintenance_queue in all (503 beyond), answered within server.maintenance_timeout_s "
    "(504 beyond); it waits for the saves queued under the cleared prefix for at most half of that "
    "(202 with complete: false when some were not written in time).",
)
async def clear_kv(
    request: Request,
    tenant: str = Depends(limited_tenant),
    cache_salt: str | None = Query(
        None,
        max_length=256,
        pattern=NO_NUL,
        description="Clear only what was stored under this salt.",
    ),
) -> JSONResponse:
    state = get_state(request)
    flush_s = state.maintenance.timeout_s / 2
    done = await state.maintenance.run(
        tenant, state.engine.clear_cache, tenant, cache_salt, flush_s
    )
    body = KVDeleted(
        tenant=tenant, cache_salt=cache_salt, deleted=done.removed, complete=done.complete
    )
    return JSONResponse(body.model_dump(), status_code=200 if done.complete else 202)
