"""kvfuse as a vLLM V1 KV connector: vLLM loads and saves prompt chunks through kvfuse's tiers.

    python -m vllm.entrypoints.openai.api_server --model ... --kv-transfer-config \\
        '{"kv_connector": "KvfuseConnector", "kv_connector_module_path": "kvfuse.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

Modules (only ``connector`` imports vLLM; ``KvfuseConnector`` is loaded on first access, so this
package imports without vLLM):

- ``blocks``: chunks vs vLLM's blocks (alignment, what to load and save), pure;
- ``layout``: where K and V lie inside vLLM's blocks, learned from vLLM's own writer, and the
  conversions between its paged tensors and kvfuse's chunk layout;
- ``plan``: the scheduler side's bookkeeping (lookups, the step's loads and saves);
- ``worker``: the worker side (layer-by-layer loads, saves through a saver thread);
- ``settings``: configuration (``kv_connector_extra_config`` over kvfuse's config) and the cache
  namespace (model fingerprint, KV dtype and layout, ``cache_salt``);
- ``stores``: one store per configuration per process;
- ``connector``: ``KvfuseConnector`` itself.

See ``docs/vllm.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvfuseConnector", "KvfuseConnectorMetadata", "KvfuseConnectorStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvfuse.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
