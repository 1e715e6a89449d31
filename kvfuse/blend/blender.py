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


def _attention_mass(
    runner: Transformer,
    layer: int,
    q: torch.Tensor,
    q_slots: torch.Tensor,
    kv: KVCache,
    n: int,
    doc_slots: torch.Tensor,
) -> torch.Tensor:
    """How much attention the queries ``q`` (the suffix's, ``(m, heads, head_dim)`` at ``q_slots``)
    give each document slot at ``layer``, summed over queries and heads: ``(len(doc_slots),)``."""
    from kvfuse.models.attention import position_mask

    c = runner.config
    keys = kv.kv[layer, 0, :, :n].float()  # (kv_heads, n, d)
    groups = c.num_heads // c.num_kv_heads
    scores = (
        torch.einsum("mhd,hnd->hmn", q.float(), keys.repeat_interleave(groups, dim=0)) * c.scaling
    )
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
    fresh: Sequence[tuple[int, int]] = (),
    selection: str | None = None,
) -> tuple[torch.Tensor, BlendStats]:
    """Fill slots ``[start, n)`` of ``kv`` for documents ``spans`` (absolute, inside ``[start,
    suffix_start)``) followed by the suffix ``[suffix_start, n)``; the logits of the last token.
    ``fresh``: slots inside ``[start, suffix_start)`` without cached KV (between found spans),
    computed at every layer like the suffix; so are slots no span covers. ``selection``: a
    bench-only selection method (``select.BENCH_METHODS``) used instead of ``options.method``.

    The cache must hold valid positions ``0..n-1`` in slots ``0..n-1`` and ``length >= n``; the
    slots before ``start`` hold the exact KV of the prefix, the document slots their cached KV
    (or receive it through ``ready``)."""
    n = len(ids)
    if n - suffix_start < 1 or suffix_start < start or kv.length < n:
        raise ValueError(
            f"blend needs a suffix and a cache of {n} slots (documents [{start}, {suffix_start}))"
        )
    if selection is not None and selection not in sel.BENCH_METHODS:
        raise ValueError(f"unknown bench selection {selection!r}")
    run, h, stats = _start_run(runner, kv, ids, start, suffix_start, spans, options, fresh)
    run.method = selection or options.method
    h = _run_layers(run, h, stats, ready)
    return runner.logits(h[-1:])[0], stats


def _start_run(
    runner: Transformer,
    kv: KVCache,
    ids: Sequence[int],
    start: int,
    suffix_start: int,
    spans: Sequence[tuple[int, int]],
    options: BlendOptions,
    fresh: Sequence[tuple[int, int]],
) -> tuple[_BlendRun, torch.Tensor, BlendStats]:
    """The blend's first rows: every slot of ``[start, n)`` (at full reuse only those without
    cached KV), which of them hold cached KV, their embeddings and rotary tables; and the stats,
    which count the document tokens the budget is a fraction of."""
    n = len(ids)
    cached = _cached_rows(start, suffix_start, n, spans, fresh).to(kv.device)
    stats = BlendStats(doc_tokens=int(cached.sum()))
    rel_spans = [
        (max(s, start) - start, min(e, suffix_start) - start)
        for s, e in spans
        if min(e, suffix_start) > s
    ]
    run = _BlendRun(runner, kv, n, start, suffix_start, options, rel_spans)
    slots = torch.arange(start, n, device=kv.device)
    # full reuse: only the fresh rows run
    run.slots, run.is_doc = (
        (slots[~cached], cached[~cached]) if options.full_reuse else (slots, cached)
    )
    h = runner.embed(
        torch.as_tensor(list(ids[start:n]), dtype=torch.int64, device=runner.device)[
            run.slots - start
        ]
    )
    run.tables = runner.rope_tables(kv.positions[run.slots], h.dtype)
    return run, h, stats


def _run_layers(
    run: _BlendRun, h: torch.Tensor, stats: BlendStats, ready: Callable[[int], None] | None
) -> torch.Tensor:
    """Run every layer over the run's rows (see the module docstring): the layers of the
    schedule's steps (from the check layer on) select document tokens and keep only those and the
    suffix for the layers after; every other layer runs all the rows left. The hidden states
    after the last layer (which computes only the last row), for the logits. ``stats`` records
    each layer's active document tokens and the tokens chosen at the check layer."""
    runner, kv, n, options = run.runner, run.kv, run.n, run.options
    c = runner.config
    check = min(options.check_layer, c.num_layers - 1)
    schedule = (
        sel.gradual_ratios(options.recompute_ratio)
        if options.gradual
        else [options.recompute_ratio]
    )
    for layer in range(c.num_layers):
        if ready is not None:
            ready(layer)
        n_active = int(run.is_doc.sum())
        stats.active.append(n_active)
        last, step = layer == c.num_layers - 1, layer - check
        if options.full_reuse or not 0 <= step < len(schedule) or n_active == 0:
            out = slice(h.shape[0] - 1, h.shape[0]) if last else None
            h = runner.layer(
                layer, h, kv, run.slots, kv_len=n, keys_sorted=True, tables=run.tables, outputs=out
            )
            continue
        q, rows, chosen_slots = run.select(layer, h, sel.budget(stats.doc_tokens, schedule[step]))
        if step == 0:
            stats.recomputed = chosen_slots.cpu()
        h = runner.attend_mlp(
            layer, q, h, kv, run.slots, kv_len=n, keys_sorted=True, rows=rows[-1:] if last else rows
        )
        if not last:
            run.keep_rows(rows)
    return h


def _cached_rows(
    start: int,
    suffix_start: int,
    n: int,
    spans: Sequence[tuple[int, int]],
    fresh: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Which slots of ``[start, n)`` hold cached KV to blend: the spans' before the suffix, less ``fresh``."""
    mask = torch.zeros(n - start, dtype=torch.bool)
    for s, e in spans:
        mask[max(s, start) - start : max(min(e, suffix_start) - start, 0)] = True
    for s, e in fresh:
        mask[max(s, start) - start : max(min(e, n) - start, 0)] = False
    return mask


class _BlendRun:
    """The rows a blend still computes (as cache slots, in slot order), which of them hold cached
    KV (``is_doc``), their rotary tables, and the selection at a filtering layer."""

    def __init__(
        self,
        runner: Transformer,
        kv: KVCache,
        n: int,
        start: int,
        suffix_start: int,
        options: BlendOptions,
        rel_spans: list[tuple[int, int]],
    ):
        self.runner, self.kv, self.n, self.start, self.suffix_start = (
            runner,
            kv,
            n,
            start,
            suffix_start,
        )
        self.options, self.rel_spans = options, rel_spans
        self.method = options.method
        self.slots = self.is_doc = torch.zeros(0)
        self.tables: dict = {}

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Compute only ``rows`` of the current rows from now on."""
        self.slots, self.is_doc = self.slots[rows], self.is_doc[rows]
        self.tables = {t: (cos[rows], sin[rows]) for t, (cos, sin) in self.tables.items()}

    def select(
        self, layer: int, h: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At a filtering layer: write every row's fresh K/V, rank the cached rows by deviation
        (and attention), keep ``k`` of them and every fresh row. Returns the queries, the rows
        kept (indices into the current rows, ascending) and the slots of the cached ones kept."""
        o, kv = self.options, self.kv
        which = 0 if o.deviation == "k" else 1
        doc_idx = torch.nonzero(self.is_doc).flatten()
        doc_slots = self.slots[doc_idx]
        cached = kv.kv[layer, which][:, doc_slots].clone()
        q = self.runner.write_kv(layer, h, kv, self.slots, self.tables)
        method = self.method
        deviation = _deviation(kv.kv[layer, which][:, doc_slots], cached, method == "hkvd-head")
        if method in ("attn", "hkvd-attn", "attn+hkvd"):
            question = torch.nonzero(self.slots >= self.suffix_start).flatten()
            mass = _attention_mass(
                self.runner, layer, q[question], self.slots[question], kv, self.n, doc_slots
            )
            deviation = {"attn": mass, "hkvd-attn": deviation * mass}.get(
                method, torch.stack([deviation, mass], dim=1)
            )
        # the budget counts all cached tokens; the active ones (after an earlier filter) are ranked
        # among themselves, each document still known by its span
        if k >= doc_idx.numel():
            chosen = torch.arange(doc_idx.numel())
        else:
            active_spans = _spans_of(doc_slots - self.start, self.rel_spans)
            chosen = sel.select(method, deviation, active_spans, k / doc_idx.numel(), o.sink_tokens)
        keep = ~self.is_doc.clone()
        keep[doc_idx[chosen.to(doc_idx.device)]] = True
        return q, torch.nonzero(keep).flatten(), doc_slots[chosen.to(doc_slots.device)]


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
