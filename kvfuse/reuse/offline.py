"""Work on an engine's model and store outside its request queue, between steps.

- ``score``: teacher-forced logits after a prompt prefilled exactly as a request would be (lookup,
  plan, loads, blend): what the quality benchmarks compare lossy reuse (blends, codecs) with a
  full prefill by (KL of next-token distributions, NLL of reference answers);
- ``precompute_documents``: documents' KV computed and stored ahead of their first use (the
  ``kvfuse precompute`` command).

Both hold the engine's ``step_lock`` while they use the model, so they never run inside a step.
They take the ``Engine`` as their first argument (not annotated: this module is what
``engine.core`` imports, never the other way round).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kvfuse.blend import BlendOptions
from kvfuse.engine.request import CacheOptions, Request
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import document_key
from kvfuse.prompts.prompt import Prompt

from .planner import Precompute
from .prefill import precompute_entry


def score(
    engine,
    prompt: Seq[int] | Prompt,
    continuations: Seq[Seq[int]] = (),
    cache: CacheOptions = CacheOptions(),
    blend: BlendOptions | None = None,
) -> list[torch.Tensor]:
    """For each continuation, a ``(len + 1, vocab)`` tensor of the logits predicting its tokens and
    the one after (the first row predicts its first token), after ``prompt`` prefilled as a request
    would be; without continuations, the prompt's last logits. Nothing is generated and the
    answers are not stored (the prompt's new chunks are, as a request's would be)."""
    if not isinstance(prompt, Prompt):
        prompt = Prompt.plain(list(prompt))
    longest = max((len(c) for c in continuations), default=0)
    request = Request(prompt, SamplingParams(max_tokens=1 + longest), cache, blend=blend)
    engine.check(request)
    seq = engine.keying.sequence(request)
    with engine.step_lock:
        request.started_at = request.enqueued_at
        engine.admit(seq, chunked=False)
        out, n = [], len(prompt)
        for cont in continuations:
            seq.kv.truncate(n)
            rows = [seq.logits[None]]
            if len(cont):
                rows.append(
                    engine.model.runner.forward(list(cont), seq.kv, logits="all").to(
                        seq.logits.dtype
                    )
                )
            out.append(torch.cat(rows))
        seq.kv = None
    return out if continuations else [seq.logits[None]]


def precompute_documents(
    engine,
    texts: Seq[str],
    cache: CacheOptions = CacheOptions(),
    blend: BlendOptions | None = None,
    on_document: Callable[[int, bool], None] | None = None,
) -> dict[str, int]:
    """Compute and store the KV of each document not cached yet (as a blended prompt would: alone,
    behind the document context); ``on_document(tokens, computed)`` after each one. Returns counts:
    documents, computed, already cached, tokens."""
    if engine.store is None:
        raise ValueError("precompute needs the KV cache, and it is disabled in this configuration")
    blend = engine.keying.resolve(blend)
    if not blend.blends:
        raise ValueError(
            "documents are not blended for this model (blend method prefix: its calibration found no "
            "budget that keeps the answers and pays off): a prompt's documents are reused only as part "
            "of an exact prefix, so there is nothing to precompute"
        )
    # ``document_context: prefix``: behind what a chat turn without a system message starts with
    # (a completion's special tokens for a model without a chat template)
    prefix = (
        engine.prompts.default_document_prefix() if blend.document_context == "prefix" else None
    )
    ns, context = (
        engine.namespace(cache.tenant, cache.salt),
        engine.keying.document_context(blend, prefix),
    )
    counts = {"documents": 0, "computed": 0, "cached": 0, "tokens": 0}
    for i, text in enumerate(texts):
        try:
            ids = engine.prompts.encode_document(text)
        except ValueError as e:
            raise ValueError(f"document {i}: {e}") from None
        if len(context) + len(ids) > engine.model.config.max_position_embeddings:
            raise ValueError(
                f"document {i} has {len(ids)} tokens: more than the model's context window"
            )
        key = document_key(ids, ns, context)
        computed = engine.store.lookup([key]).where[0] is None
        if computed:
            with engine.step_lock:
                entry = precompute_entry(
                    engine.model.runner,
                    engine.kv_dtype,
                    engine.codec,
                    Precompute(key, tuple(ids), context),
                )
            engine.writer.precomputed(cache, key, entry, len(ids))
        counts["documents"] += 1
        counts["computed" if computed else "cached"] += 1
        counts["tokens"] += len(ids)
        if on_document is not None:
            on_document(len(ids), computed)
    engine.stats.add(chunks_stored=counts["computed"])
    return counts
