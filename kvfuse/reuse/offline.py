"""Documents' KV computed and stored ahead of their first use (the ``kvfuse precompute`` command,
``Engine.precompute_documents``): each document alone, behind the document context, exactly as a
blended prompt that misses it would compute and store it. The model is used under the engine's
step lock (``model_lock``), so this never runs inside a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

from kvfuse.blend import BlendOptions
from kvfuse.kv.keys import document_key

from .options import CacheOptions
from .parts import Parts
from .planner import Precompute
from .prefill import precompute_entry


def precompute_documents(
    p: Parts,
    model_lock: threading.Lock,
    documents: Seq[list[int]],
    cache: CacheOptions,
    blend: BlendOptions | None,
    prefix: list[int] | None,
    on_document: Callable[[int, bool], None] | None = None,
) -> dict[str, int]:
    """Compute and store the KV of each document (its token ids) not cached yet;
    ``on_document(tokens, computed)`` after each one. ``prefix``: what ``document_context:
    prefix`` computes documents behind. Returns counts: documents, computed, cached, tokens."""
    blend = p.keying.resolve(blend)
    if not blend.blends:
        raise ValueError(
            "documents are not blended for this model (blend method prefix: its calibration found "
            "no budget that keeps the answers and pays off): a prompt's documents are reused only "
            "as part of an exact prefix, so there is nothing to precompute"
        )
    ns = p.keying.namespace(cache.tenant, cache.salt)
    context = p.keying.document_context(blend, prefix)
    window = p.runner.config.max_position_embeddings
    counts = {"documents": 0, "computed": 0, "cached": 0, "tokens": 0}
    for i, ids in enumerate(documents):
        if len(context) + len(ids) > window:
            raise ValueError(
                f"document {i} has {len(ids)} tokens: more than the model's context window"
            )
        key = document_key(ids, ns, context)
        computed = p.store.lookup([key]).where[0] is None
        if computed:
            with model_lock:
                step = Precompute(key, tuple(ids), context)
                entry = precompute_entry(p.runner, p.kv_dtype, p.codec, step)
            p.writer.precomputed(cache, key, entry, len(ids))
        counts["documents"] += 1
        counts["computed" if computed else "cached"] += 1
        counts["tokens"] += len(ids)
        if on_document is not None:
            on_document(len(ids), computed)
    p.stats.add(chunks_stored=counts["computed"])
    return counts
