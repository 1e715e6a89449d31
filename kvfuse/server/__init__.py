"""The OpenAI-compatible HTTP server.

Layout (the request's path through it):

- ``middleware``  request id, JSON request log, request metrics, body-size limit
- ``auth``        API key -> tenant; ``tenants``: the tenant's cache namespace salt
- ``schemas``     request/response bodies (kvfuse's extension fields: ``KVFuseOptions``)
- ``translate``   request -> one engine call (token ids, SamplingParams, CacheOptions); all 4xx checks
- ``scheduler``   the bounded request queue and the single engine worker thread
- ``completions`` the generation endpoints (JSON and server-sent events); ``responses``: their bodies
- ``admin``       models, health, metrics, KV cache stats and clearing; ``metrics``: Prometheus
- ``errors``      OpenAI-style error bodies; ``state``: what one app holds; ``app``: factory and ``serve``
"""

from .app import create_app, serve

__all__ = ["create_app", "serve"]
