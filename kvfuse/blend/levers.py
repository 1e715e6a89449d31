"""Training-free levers for dense deviation (issue 41): APE's attention correction and
layer-split recompute, as functions over the model runner's layer API.

They are bench methods (``bench/blend_loss.py`` measures them against full prefill); none is a
``blend.method`` of the engine yet, because none met the bar on the dev split (see
``docs/blend.md``). They stay here, tested, so that a serving path can adopt the one that wins.

- **APE** (arXiv 2502.05431): the documents' KV is computed behind a shared prefix and reused
  without recompute; the queries of the tokens after them (the question, the answer) read the
  documents' keys with a temperature ``T`` (their logits divided by ``T``) and the documents'
  share of the attention scaled through their log-sum-exp (``S * lse``), then the two parts
  (documents; everything else: prefix, question, answer so far) are merged by their log-sum-exp.
  With ``T = S = 1`` this is exactly ordinary attention (a unit test checks it).
- **Layer-split recompute** (after DroidSpeak, arXiv 2411.02820): the cached KV of layers below a
  split layer is kept, and every document token is recomputed from the split layer on, starting
  from the hidden state the document had at the split layer when it was computed alone (stored
  with its KV). Costs ``(L - split) / L`` of the documents' prefill.
"""

from __future__ import annotations

import torch

from kvfuse.models.attention import position_mask
from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer


def ape_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    context: torch.Tensor,
    *,
    scale: float,
    temperature: float = 1.0,
    lse_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """APE attention output ``(n_q, heads * head_dim)``; shapes as ``attention.attend``, and
    ``context`` a ``(n_k,)`` bool mask of the keys that are cached documents. The documents' logits
    are divided by ``temperature``; their log-sum-exp is multiplied by ``lse_scale`` before the
    merge with the other keys'. Computed in float32 (eager: the correction needs the scores)."""
    groups = q.shape[0] // k.shape[0]
    kf = k.float().repeat_interleave(groups, dim=0)
    vf = v.float().repeat_interleave(groups, dim=0)
    scores = torch.matmul(q.float(), kf.transpose(1, 2)) * scale  # (heads, n_q, n_k)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = position_mask(q_pos, k_pos, window)
    ctx = context.to(torch.bool)[None, :] & visible
    rest = ~context.to(torch.bool)[None, :] & visible
    out_c, lse_c = _part(scores / temperature, ctx, vf)
    out_r, lse_r = _part(scores, rest, vf)
    w = torch.sigmoid(lse_scale * lse_c - lse_r).nan_to_num(0.0)  # the documents' share
    out = w[..., None] * out_c + (1 - w[..., None]) * out_r
    return out.transpose(0, 1).reshape(q.shape[1], -1).to(q.dtype)


def _part(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor):
    """Softmax attention over the keys in ``mask`` only: its output and log-sum-exp (``-inf`` and
    a zero output where a query sees none of them)."""
    s = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (heads, n_q)
    probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(probs, v), lse


@torch.inference_mode()
def ape_forward(
    runner: Transformer,
    tokens: list[int],
    cache: KVCache,
    context: torch.Tensor,
    temperature: float,
    lse_scale: float,
) -> torch.Tensor:
    """``runner.forward(tokens, cache, logits="all")`` with APE attention in every layer:
    ``context`` marks the first slots of the cache that hold cached documents (slots past its
    length and the new tokens are never context). Returns ``(len(tokens), vocab)`` logits."""
    c, n0, n = runner.config, cache.length, len(tokens)
    cache.reserve(n0 + n)
    cache.positions[n0 : n0 + n] = torch.arange(cache.next_position, cache.next_position + n)
    slots = torch.arange(n0, n0 + n, device=cache.device)
    mask = torch.zeros(n0 + n, dtype=torch.bool, device=cache.device)
    k = min(n0, context.shape[0])  # slots past ``context`` (earlier answer tokens) are not context
    mask[:k] = context[:k].to(cache.device)
    tables = runner.rope_tables(cache.positions[slots], runner.dtype)
    h = runner.embed(torch.as_tensor(tokens, dtype=torch.int64))
    for layer in range(c.num_layers):
        q = runner.write_kv(layer, h, cache, slots, tables)
        attn = ape_attend(
            q.transpose(0, 1),
            cache.kv[layer, 0, :, : n0 + n],
            cache.kv[layer, 1, :, : n0 + n],
            cache.positions[slots],
            cache.positions[: n0 + n],
            mask,
            scale=c.scaling,
            temperature=temperature,
            lse_scale=lse_scale,
            window=c.window(layer),
            softcap=c.attn_logit_softcap,
        )
        h = runner.post_attention(layer, attn, h)
    cache.length = n0 + n
    return runner.logits(h)


@torch.inference_mode()
def hidden_at(runner: Transformer, tokens: list[int], cache: KVCache, split: int) -> torch.Tensor:
    """Prefill ``tokens`` into ``cache`` (after its valid slots) for layers ``[0, split)`` only and
    return their hidden states entering layer ``split``: what layer-split reuse stores with a
    document's KV (the layers from ``split`` on are left unwritten)."""
    n0, n = cache.length, len(tokens)
    cache.reserve(n0 + n)
    cache.positions[n0 : n0 + n] = torch.arange(cache.next_position, cache.next_position + n)
    slots = torch.arange(n0, n0 + n, device=cache.device)
    tables = runner.rope_tables(cache.positions[slots], runner.dtype)
    h = runner.embed(torch.as_tensor(tokens, dtype=torch.int64))
    for layer in range(split):
        h = runner.layer(layer, h, cache, slots, kv_len=n0 + n, tables=tables)
    cache.length = n0 + n
    return h


@torch.inference_mode()
def recompute_above(
    runner: Transformer,
    cache: KVCache,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    split: int,
    kv_len: int,
) -> None:
    """Layer-split reuse: from layer ``split`` on, recompute the tokens at ``slots`` (in slot
    order) from their stored hidden states ``hidden`` (entering ``split``), attending in context
    to slots ``[0, kv_len)``; their fresh K/V replace the cached ones. Layers below ``split`` keep
    the cached KV."""
    tables = runner.rope_tables(cache.positions[slots], runner.dtype)
    h = hidden
    last = runner.config.num_layers - 1
    for layer in range(split, runner.config.num_layers):
        out = slice(0, 0) if layer == last else None  # the last layer's outputs feed nothing
        h = runner.layer(layer, h, cache, slots, kv_len=kv_len, tables=tables, outputs=out)
