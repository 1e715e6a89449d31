"""KV events for cache-aware routers, in vLLM's format (``server.kv_events``; docs/routers.md).

``blocks`` (block hashes of a chunk), ``tracker`` (which chunks were announced, and where),
``wire`` (vLLM's msgspec classes), ``publisher`` (the thread and the ZMQ sockets), ``hub`` (the
hooks into an engine's tiers and cache writer). Only a server started with ``--kv-events``
imports the modules that need ``pyzmq`` and ``msgspec`` (``kvfuse[events]``).
"""
