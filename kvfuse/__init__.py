"""kvfuse: compute a long context's KV cache once, keep it in memory / on disk / in Redis, reuse it.

Data flow (one package per step): tokens -> ``kv`` (chunk keys, the chunk type, the serialized
format) -> ``codecs`` -> ``tiers`` -> ``models`` (the model runner) -> ``engine`` -> ``server``.
"""

__version__ = "0.1.0"
