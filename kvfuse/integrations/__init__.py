"""Integrations of kvfuse's store into other serving engines.

- ``kvfuse.integrations.vllm``: a vLLM V1 KV connector (``KvfuseConnector``) that loads and saves
  prompt chunks through kvfuse's tiers (memory, disk, Redis). See ``docs/vllm.md``.

Each integration imports its engine lazily: ``import kvfuse.integrations.vllm`` works without vLLM
installed (its bookkeeping is pure and tested on its own); only the connector class needs vLLM.
"""
