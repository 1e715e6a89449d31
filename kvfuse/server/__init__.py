"""The OpenAI-compatible HTTP server.

Layout (the request's path through it):

- ``middleware``  request id, JSON request log, request metrics, body-size limit
- ``auth``        API key -> tenant; ``deps``: the FastAPI dependencies (app state, caller's tenant)
- ``schemas``     request/response bodies (kvfuse's extension fields: ``KVFuseOptions``)
- ``translate``   request -> one engine request (token ids, SamplingParams, CacheOptions); all 4xx checks
- ``completions`` the generation endpoints: submit to the engine's queue, relay JSON or server-sent
                  events; ``events``: engine thread -> event loop; ``bodies``: the response bodies
- ``responses_api`` OpenAI's Responses API (stored responses: ``kvfuse.history.response_store``)
- ``admin``       models, health, metrics, KV cache stats and clearing; ``metrics``: Prometheus
- ``errors``      OpenAI-style error bodies; ``request_log``: the request log record; ``state``: what one
                  app holds; ``app``: factory and ``serve``

The server schedules nothing itself: the queue, its worker and cancellation live in the engine.
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
