"""The logprobs of a prompt's own tokens (``echo`` with ``logprobs``), once its KV is complete.

A prefill computes the logits of the prompt's last token only, and a cached part of the prompt
was never computed here at all. Rather than refuse, ``prompt_logprobs`` runs the prompt's tokens
through the model once more, reading the KV the prefill (or the cache) already put in the live
cache instead of writing any: each layer projects the tokens' queries and attends to the stored
K/V by position (``Transformer.project`` + ``attend_mlp``, the layer-by-layer API), so no extra
KV memory is taken and the live cache is left exactly as it was. The cost is a prefill's compute
over the whole prompt (its projections, attention and MLP, plus the vocabulary projection of
every token), in slices of ``ROWS`` tokens so that the ``(rows, vocab)`` logits stay small. For
an exactly reused or computed prefix the result is that of a full forward pass over the prompt,
up to float rounding; for blended documents it is the distribution given the blended KV the
answer was generated from.
"""

from __future__ import annotations

import torch

from kvfuse.models.cache import KVCache
from kvfuse.models.transformer import Transformer
from kvfuse.sampling.logprobs import TokenLogprob, rows_logprobs

ROWS = 256  # prompt tokens per slice (the logits of a slice: ROWS x vocabulary floats)


@torch.inference_mode()
def prompt_logprobs(
    runner: Transformer, kv: KVCache, ids: list[int], top: int
) -> list[TokenLogprob | None]:
    """One entry per prompt token: None for the first (nothing predicts it), then each token's
    logprob given those before it, with ``top`` alternatives. ``kv`` holds the prompt's KV in
    slots ``[0, len(ids))`` (with their positions), as after the prompt's prefill."""
    n = len(ids)
    if kv.length < n:
        raise ValueError(f"the live KV holds {kv.length} slots, fewer than the prompt's {n}")
    out: list[TokenLogprob | None] = [None]
    keys_sorted = kv.keys_sorted(n)
    for start in range(0, n - 1, ROWS):
        end = min(n - 1, start + ROWS)  # tokens [start, end) predict ids[start + 1 : end + 1]
        logits = _logits(runner, kv, ids[start:end], slice(start, end), n, keys_sorted)
        out += rows_logprobs(logits, ids[start + 1 : end + 1], top)
    return out


def _logits(
    runner: Transformer, kv: KVCache, ids: list[int], slots: slice, n: int, keys_sorted: bool
) -> torch.Tensor:
    """The logits after the tokens in ``slots`` (their ids ``ids``), attending to the stored KV
    of the first ``n`` slots and writing none."""
    positions = kv.positions[slots]
    tables = runner.rope_tables(positions, runner.dtype)
    h = runner.embed(torch.as_tensor(ids, dtype=torch.int64))
    for layer in range(runner.config.num_layers):
        q, _, _ = runner.project(layer, h, positions, tables)
        h = runner.attend_mlp(layer, q, h, kv, slots, kv_len=n, keys_sorted=keys_sorted)
    return runner.logits(h)
