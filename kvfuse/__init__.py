"""kvfuse: compute a long context's KV cache once, keep it in memory / on disk / in Redis, reuse it.

Data flow (one package per step): ``server`` -> ``engine`` (queue and admission, a step of
schedule -> run -> post-process, a pure planner, one plan executor) -> ``kv`` (typed chunk keys, the chunk type, the serialized format and its one
validation path) -> ``codecs`` -> ``tiers`` -> ``models`` (the model runner). See
``docs/architecture.md``.
"""

__version__ = "0.1.0"
