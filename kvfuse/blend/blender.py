"""The blended prefill: documents' cached KV fused in context by recomputing a few tokens.

The documents' KV was computed on its own and loaded into the prompt's slots with its keys moved
to their positions, so each document ignores what precedes it. Layer by layer (CacheBlend):

- layers before ``check_layer`` ("full" layers) run for every document token and the suffix;
- at the check layer every active token's fresh K/V is computed and written; the deviation
  between fresh and cached K (or V) ranks the document tokens and ``select`` picks the budget.
  Attention and the MLP then run only for the selected tokens and the suffix;
- later layers run only for those tokens (with ``gradual``, the set shrinks over three more
  layers by each layer's deviation), their fresh K/V overwriting the cached entries, their
  queries attending to every slot by position (exact causal masks, sliding windows included).

The suffix (the question) has no cached KV and is computed at every layer. At ratio 0 (full
reuse) no document token is recomputed and there are no full layers: only the suffix runs, over
the concatenated documents. At ratio 1 every token is recomputed at every layer: a prefill.

``ready(layer)`` is called before a layer is used: the layer loader fills the documents' KV of
layer i+1 while layer i computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer

from . import select as sel
from .options import BlendOptions


@dataclass
class BlendStats:
    doc_tokens: int
    # the document tokens recomputed beyond the full layers (chosen at the check layer), as slots
    recomputed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    active: list[int] = field(default_factory=list)  # document tokens computed at each layer

    @property
    def selected(self) -> int:
        return int(self.recomputed.numel())


def _attention_mass(runner: Transformer, layer: int, q: torch.Tensor, q_slots: torch.Tensor, kv: KVCache,
                    n: int, doc_slots: torch.Tensor) -> torch.Tensor:
    """How much attention the queries ``q`` (the suffix's, ``(m, heads, head_dim)`` at ``q_slots``)
    give each document slot at ``layer``, summed over queries and heads: ``(len(doc_slots),)``."""
    from kvfuse.models.attention import position_mask

    c = runner.config
    keys = kv.kv[layer, 0, :, :n].float()  # (kv_heads, n, d)
    groups = c.num_heads // c.num_kv_heads
    scores = torch.einsum("mhd,hnd->hmn", q.float(), keys.repeat_interleave(groups, dim=0)) * c.scaling
    if c.attn_logit_softcap is not None:
        scores = torch.tanh(scores / c.attn_logit_softcap) * c.attn_logit_softcap
    mask = position_mask(kv.positions[q_slots], kv.positions[:n], c.window(layer))
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probs[:, :, doc_slots].sum(dim=(0, 1))


def _deviation(fresh: torch.Tensor, cached: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Squared L2 distance per token between ``(heads, n, head_dim)`` tensors: ``(n,)``, or
    ``(n, heads)`` per head."""
    d = (fresh.float() - cached.float()).pow_(2).sum(dim=2)  # (heads, n)
    return d.transpose(0, 1) if per_head else d.sum(dim=0)


@torch.inference_mode()
def blend_prefill(
    runner: Transformer,
    kv: KVCache,
    ids: Sequence[int],
    start: int,
    suffix_start: int,
    spans: Sequence[tuple[int, int]],
    options: BlendOptions,
    ready: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, BlendStats]:
    """Fill slots ``[start, n)`` of ``kv`` for documents ``spans`` (absolute, inside ``[start,
    suffix_start)``) followed by the suffix ``[suffix_start, n)``; the logits of the last token.

    The cache must hold valid positions ``0..n-1`` in slots ``0..n-1`` and ``length >= n``; the
    slots before ``start`` hold the exact KV of the prefix, the document slots their cached KV
    (or receive it through ``ready``)."""
    n = len(ids)
    c = runner.config
    n_doc, n_suffix = suffix_start - start, n - suffix_start
    if n_suffix < 1 or n_doc < 0 or kv.length < n:
        raise ValueError(f"blend needs a suffix and a cache of {n} slots (documents [{start}, {suffix_start}))")
    rel_spans = [(max(s, start) - start, min(e, suffix_start) - start) for s, e in spans if min(e, suffix_start) > s]
    stats = BlendStats(doc_tokens=n_doc)
    ratio = options.recompute_ratio
    check = min(options.check_layer, c.num_layers - 1)
    per_head = options.method == "hkvd-head"
    which = 0 if options.deviation == "k" else 1
    schedule = sel.gradual_ratios(ratio) if options.gradual else [ratio]

    slots = torch.arange(start, n, device=kv.device)  # the rows still computed, as cache slots
    n_active_docs = n_doc
    if options.full_reuse:  # only the suffix runs: the documents' KV is used as stored
        slots, n_active_docs = slots[n_doc:], 0
    h = runner.embed(torch.as_tensor(list(ids[start:n]) if not options.full_reuse else list(ids[suffix_start:n]),
                                     dtype=torch.int64, device=runner.device))
    tables = runner.rope_tables(kv.positions[slots], h.dtype)

    def keep(rows: torch.Tensor) -> None:  # the rows computed from now on (h is already theirs)
        nonlocal slots, tables, n_active_docs
        n_active_docs = int((rows < n_active_docs).sum())
        slots = slots[rows]
        tables = {t: (cos[rows], sin[rows]) for t, (cos, sin) in tables.items()}

    for layer in range(c.num_layers):
        if ready is not None:
            ready(layer)
        stats.active.append(n_active_docs)
        last = layer == c.num_layers - 1
        step = layer - check
        filtering = not options.full_reuse and 0 <= step < len(schedule) and n_active_docs > 0
        if not filtering:
            rows = slice(h.shape[0] - 1, h.shape[0]) if last else None
            h = runner.layer(layer, h, kv, slots, kv_len=n, keys_sorted=True, tables=tables, outputs=rows)
            continue
        doc_slots = slots[:n_active_docs]
        cached = kv.kv[layer, which][:, doc_slots].clone()
        q = runner.write_kv(layer, h, kv, slots, tables)
        deviation = _deviation(kv.kv[layer, which][:, doc_slots], cached, per_head)
        if options.method in ("attn", "hkvd-attn"):
            mass = _attention_mass(runner, layer, q[n_active_docs:], slots[n_active_docs:], kv, n, doc_slots)
            deviation = mass if options.method == "attn" else deviation * mass
        # the budget counts all document tokens; the active ones (after an earlier filter) are
        # ranked among themselves, each document still known by its span
        k = sel.budget(n_doc, schedule[step])
        if k >= n_active_docs:
            chosen = torch.arange(n_active_docs)
        else:
            active_spans = _spans_of(doc_slots - start, rel_spans)
            chosen = sel.select(options.method, deviation, active_spans, k / n_active_docs, options.sink_tokens)
        rows = sel.with_suffix(chosen, n_active_docs, h.shape[0] - n_active_docs)
        if step == 0:
            stats.recomputed = doc_slots[chosen].cpu()
        out_rows = rows[-1:] if last else rows
        h = runner.attend_mlp(layer, q, h, kv, slots, kv_len=n, keys_sorted=True, rows=out_rows)
        if not last:
            keep(rows)
    return runner.logits(h[-1:])[0], stats


def _spans_of(positions: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans (in row indices of ``positions``, sorted document-relative positions) of the
    documents that still have tokens among ``positions``."""
    out, pos = [], positions.tolist()
    i = 0
    for s, e in spans:
        j = i
        while j < len(pos) and pos[j] < e:
            j += 1
        if j > i:
            out.append((i, j))
        i = j
    return out
