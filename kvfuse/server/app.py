"""The FastAPI app factory and ``serve``: uvicorn with a graceful, flushing shutdown.

``create_app(config, engine)`` builds an app around an engine (or opens one from the config at
start-up). ``serve(config)`` opens the engine, listens, and on SIGTERM/SIGINT stops accepting
connections, lets the requests in flight finish (``shutdown_grace_s``), cancels what is left,
and flushes the store's pending lower-tier writes before returning; a signal-initiated stop is a
normal exit (the process exits with status 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from kvfuse import __version__
from kvfuse.config import Config

from . import admin, completions, messages_api, render, responses_api, workers
from .auth_middleware import AuthMiddleware
from .errors import install_error_handlers
from .middleware import BodyLimitMiddleware, RequestContextMiddleware
from .state import CLOSE_GRACE_S, ServerState

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0

_DESCRIPTION = """\
An OpenAI-compatible API in front of the kvfuse engine, which reuses the KV cache of repeated prompt
prefixes across memory, disk and Redis tiers.

* `usage.prompt_tokens_details.cached_tokens` reports the prompt tokens reused from the cache.
* kvfuse extension fields in the request body (`extra_body` with the `openai` client): `cache_salt`
  (an extra namespace inside your tenant), `cache` (`false`: neither read nor write the cache),
  `documents` and `recompute_ratio` (CacheBlend), `blend_auto` (`on`: find cached passages inside a
  plain prompt, at any position) and `kv_slo_ms`.
* With API keys configured (`--api-key KEY:TENANT`), each key's tenant has its own cache namespace.
* Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`; every response carries
  an `x-request-id` header, also found in the server's JSON request log.
* Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) takes `x-api-key` (or a
  bearer token) and answers errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""


def create_app(config: Config, serving=None, clock: Callable[[], float] | None = None) -> FastAPI:
    """The app serving ``serving`` (``runtime.Serving``: an engine and its prompt builder; None:
    opened from ``config`` at start-up and closed at shutdown).

    A given engine is not closed by the app: its loop is stopped and its store flushed at shutdown.
    ``clock``: the wall clock stored responses (and an engine opened here) expire by.
    """
    state = ServerState(config, serving, clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(state.start)
        try:
            yield
        finally:
            await asyncio.to_thread(state.stop)

    app = FastAPI(title="kvfuse", version=__version__, description=_DESCRIPTION, lifespan=lifespan)
    app.state.kvfuse = state
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(responses_api.router)
    app.include_router(messages_api.router)
    app.include_router(admin.router)
    app.include_router(workers.router)
    app.include_router(render.router)
    # Added last = outermost: the request context sees every response, the 413s included; the
    # key is checked before anything reads the body.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.server.max_body_bytes,
        body_timeout_s=config.server.body_timeout_s,
    )
    app.add_middleware(
        AuthMiddleware,
        auth=state.auth,
        failures_per_minute=config.server.auth_failures_per_minute,
    )
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics)
    _publish_limits(app, config)
    return app


def _publish_limits(app: FastAPI, config: Config) -> None:
    """Put the configured max_tokens limit into the published schema (``maximum``), so that clients
    and schema-driven tools see it."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for name in (
                "SamplingRequest",
                "CompletionRequest",
                "ChatCompletionRequest",
                "ResponseCreateRequest",
                "MessagesRequest",
            ):
                props = (
                    schema.get("components", {})
                    .get("schemas", {})
                    .get(name, {})
                    .get("properties", {})
                )
                for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    prop = props.get(field, {})
                    for variant in prop.get("anyOf", [prop]):
                        if variant.get("type") == "integer":
                            variant["maximum"] = config.server.max_tokens_limit
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class _Server(uvicorn.Server):
    """uvicorn's server, with a start-up callback and no re-raised signal after a graceful stop."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None] | None):
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")

    def handle_exit(self, sig, frame) -> None:
        # /health answers 503 from the signal on, while uvicorn lets the requests in flight end.
        state = getattr(getattr(self.config.app, "state", None), "kvfuse", None)
        if state is not None:
            state.drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after its graceful shutdown, so the process would die of it;
        # a requested stop that completed cleanly is a normal exit here.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _configure_logging(config: Config) -> None:
    """One JSON line per request on stderr, at the configured level (info by default)."""
    requests_log = logging.getLogger("kvfuse.server.requests")
    requests_log.setLevel(config.log_level.upper())
    if not requests_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        requests_log.addHandler(handler)
        requests_log.propagate = False


def serve(config: Config, on_ready: Callable[[str, object], None] | None = None) -> None:
    """Run the server until SIGTERM/SIGINT; ``on_ready(url, engine)`` is called once it listens
    (``engine``: the engine serving, for the start-up lines)."""
    from kvfuse.runtime import open_serving
    from kvfuse.threads import hand_over

    _configure_logging(config)
    serving = open_serving(config)  # load errors surface here, before anything listens
    hand_over()  # this thread loaded the model and runs the event loop; the engine computes
    ready = None if on_ready is None else (lambda url: on_ready(url, serving.engine))
    try:
        app = create_app(config, serving)
        uv_config = uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            access_log=False,
            lifespan="on",
            log_level=config.log_level.lower(),
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            # connections and requests at once; beyond it uvicorn answers 503 without reading them
            limit_concurrency=config.server.limit_concurrency or None,
            log_config=None,
        )
        _Server(uv_config, ready).run()
    finally:
        # the lifespan's stop flushed what was queued for disk / Redis within its deadline
        serving.engine.close(flush_timeout=CLOSE_GRACE_S)
