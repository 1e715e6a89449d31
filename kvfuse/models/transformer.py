"""The model runner: a decoder-only transformer in plain PyTorch, driven layer by layer.

One code path serves every family; ``ModelConfig`` says which features a model uses. The API is
shaped for the cache features built on top of it:

- ``forward(tokens, cache)`` runs all layers over new tokens placed after the cache's valid slots
  (at positions that continue it, or at explicit positions), attending to whatever KV the cache
  already holds (a prefix loaded from a tier, say), and computes logits only where asked;
- ``embed`` / ``layer`` / ``logits`` expose the same computation one layer at a time, with the
  K/V of the processed tokens written to chosen *slots*: CacheBlend recomputes a subset of tokens
  in the middle of a prompt this way, their queries attending to the full KV by position;
- ``project`` returns one layer's fresh q/k/v without touching the cache (CacheBlend's check
  layer compares them with the cached values).

Weights are plain tensors or packed projections (no ``nn.Module``). Every operation runs through
the model's CPU backend (``self.backend``, ``cpu.backend``: kvfuse's kernels or PyTorch's
operators, chosen once at load), so that nothing here decides which. The q/k/v projections are
fused into one matmul; gate and up are not: on this CPU one (n, 2 x intermediate) output ran ~10%
slower than two (n, intermediate) ones at 512 tokens (larger output than the caches hold), and
equal at 2048.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import batch, pointwise, rope
from .attention import attend
from .cache import KVBudget, KVCache
from .config import ModelConfig
from .cpu.backend import CpuBackend, select


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, hidden)
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor  # (intermediate, hidden)
    w_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (gemma)
    mlp_out_norm: torch.Tensor | None = None


@dataclass
class Weights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied


@dataclass
class BatchItem:
    """One sequence's part of a batched step (``Transformer.forward_batch``): its new tokens, its
    cache (the tokens go after its valid slots), their positions (default: continuing the cache)
    and whether the logits of its last token are wanted."""

    ids: list[int]
    cache: KVCache
    positions: torch.Tensor | None = None
    logits: bool = True
    start: int | None = (
        None  # the first slot written (default: after the valid slots), as in forward()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (weights of gemma-style norms already include the +1), with
    PyTorch's ``F.rms_norm`` (the runner itself uses ``pointwise.rms_norm``, one kernel call on
    the CPU)."""
    return pointwise.rms_norm(x, weight, eps)


class Transformer:
    """A loaded model on one device, in one compute dtype. See the module docstring for the API."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        device: torch.device,
        dtype: torch.dtype,
        backend: CpuBackend | None = None,
    ):
        """``backend``: the CPU path chosen for this model (``cpu.backend.select``, as the loader
        does; default: chosen now from the environment's ``kernels`` setting)."""
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self._freqs = {
            t: rope.inv_freq(r, config.head_dim).to(device) for t, r in config.rope.items()
        }
        self._chosen = backend or select(None, device, dtype)
        self.use_kernels = self._chosen.mode != "off"  # binds ``self.backend``
        c = config
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self._embed_scale = (
            None if c.embed_scale is None else torch.tensor(c.embed_scale, dtype=dtype)
        )

    @property
    def use_kernels(self) -> bool:
        """Whether this runner uses kvfuse's CPU kernels (batched attention, pointwise ops, fused
        layers) where its backend has them. Set False for the plain PyTorch path (the weights stay
        in their form)."""
        return self._use_kernels

    @use_kernels.setter
    def use_kernels(self, on: bool) -> None:
        self._use_kernels = bool(on)
        # The stack's rope kinds in the order of ``self._freqs``, in which ``forward_batch`` hands
        # over the rotation tables.
        self.backend = self._chosen.bind(self.config, self.weights, list(self._freqs), bool(on))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, weight, self.config.rms_norm_eps)

    # ----------------------------------------------------------------------------- whole passes

    def new_cache(
        self, capacity: int = 0, dtype: torch.dtype | None = None, budget: KVBudget | None = None
    ) -> KVCache:
        """An empty KV cache for one sequence (KV dtype defaults to the compute dtype), its bytes
        counted in ``budget`` if given (OutOfKVMemory when they do not fit)."""
        return KVCache(self.config, capacity, dtype or self.dtype, self.device, budget)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],
        cache: KVCache,
        positions: torch.Tensor | None = None,
        logits: str = "last",
        start: int | None = None,
    ) -> torch.Tensor | None:
        """Run all layers over ``tokens``, written to slots ``start..`` (default: after the cache's
        valid slots; an earlier ``start`` replaces what those slots held).

        ``positions`` default to continuing the cache (``cache.next_position``). Queries attend to
        every valid slot by position, so tokens computed in the middle of a prompt see exactly the
        keys before them. ``logits`` is
        ``"last"`` (a ``(vocab,)`` vector for the last token), ``"all"`` (``(n, vocab)``) or
        ``"none"``: the vocabulary projection is most of a small model's prefill cost, so a
        prefill only pays for the row it samples from.
        """
        ids = torch.as_tensor(tokens, dtype=torch.int64, device=self.device).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
        start = cache.length if start is None else start
        if not 0 <= start <= cache.length:
            raise ValueError(f"slot {start} would leave a gap after the {cache.length} valid slots")
        if positions is None:
            positions = torch.arange(
                cache.next_position, cache.next_position + n, device=self.device
            )
        positions = torch.as_tensor(positions, dtype=torch.int64, device=self.device).reshape(-1)
        if positions.shape[0] != n:
            raise ValueError(f"{n} tokens but {positions.shape[0]} positions")
        cache.reserve(start + n)
        cache.positions[start : start + n] = positions
        slots = slice(start, start + n)
        kv_len = max(cache.length, start + n)
        sorted_keys = cache.keys_sorted(kv_len)
        tables = self.rope_tables(positions, self.dtype)
        h = self.embed(ids)
        last = self.config.num_layers - 1
        # The last layer's K/V are needed for every token, its outputs only where logits are asked.
        needed = {"all": None, "last": slice(n - 1, n), "none": slice(0, 0)}[logits]
        for layer in range(self.config.num_layers):
            h = self.layer(
                layer,
                h,
                cache,
                slots,
                kv_len=kv_len,
                keys_sorted=sorted_keys,
                tables=tables,
                outputs=needed if layer == last else None,
            )
        cache.length = kv_len
        if logits == "none":
            return None
        return self.logits(h)[0] if logits == "last" else self.logits(h)

    @torch.inference_mode()
    def forward_batch(self, items: list[BatchItem]) -> list[torch.Tensor | None]:
        """One pass over several sequences, each with its own cache: ``forward`` for each item, with
        the dense parts (projections, MLP, vocabulary) run once over all their tokens.

        Weights are read once per step whatever the number of sequences, which is what makes
        batching pay on a memory-bound decode; attention stays per sequence (own slots, own
        positions): see ``batch`` (one kernel call per layer for the decoding sequences, SDPA for
        prefill chunks, both prepared once per step). Returns, per item, the
        ``(vocab,)`` logits of its last token, or None where ``item.logits`` is False.
        Each item gets exactly what ``forward(item.ids, item.cache, item.positions)`` computes, up
        to the rounding of GEMMs over more rows."""
        if not items:
            return []
        step, positions = batch.prepare(self, items)
        ids = torch.as_tensor(
            [t for it in items for t in it.ids], dtype=torch.int64, device=self.device
        )
        tables = self.rope_tables(positions, self.dtype)
        h = self.embed(ids)
        stacked = self.backend.run_stack(step, h, [tables[t] for t in self._freqs])
        h = stacked if stacked is not None else self._layers_batch(step, h, positions, tables)
        for s in step.spans:
            s.cache.length = s.kv_len
        out: list[torch.Tensor | None] = [None] * len(items)
        if h.shape[0]:
            logits = self.logits(h)
            for j, i in enumerate(i for i, it in enumerate(items) if it.logits):
                out[i] = logits[j]
        return out

    def _layers_batch(
        self, step: batch.BatchStep, h: torch.Tensor, positions: torch.Tensor, tables
    ) -> torch.Tensor:
        """``forward_batch``'s layers one by one (what ``run_stack`` does in one call when it applies):
        the hidden states after the last layer, only the rows of ``step.last_rows`` there."""
        last = self.config.num_layers - 1
        for layer in range(self.config.num_layers):
            q, k, v = self._project(layer, h, positions, tables)
            step.write_kv(layer, k, v)
            if layer == last:
                if not step.last_rows:
                    h = h[:0]
                    break
                h = h[step.last_rows]
            h = self.post_attention(layer, step.attend(layer, q, last=layer == last), h)
        return h

    # ---------------------------------------------------------------------- layer-by-layer API

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.weights.embed
        ids = ids.to(self.device)
        h = F.embedding(ids, e) if isinstance(e, torch.Tensor) else e.rows(ids)
        return h * self._embed_scale if self._embed_scale is not None else h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + vocabulary projection for the given hidden states ``(n, hidden)``."""
        c = self.config
        out = self.backend.linear(self._norm(h, self.weights.final_norm), self.weights.lm_head)
        if c.final_logit_softcap is not None:
            out = torch.tanh(out / c.final_logit_softcap) * c.final_logit_softcap
        return out

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin tables per layer type for ``positions``: computed once per pass, not per layer."""
        positions = positions.to(self.device)
        return {t: rope.cos_sin(f, positions, dtype) for t, f in self._freqs.items()}

    @torch.inference_mode()
    def project(self, layer: int, h: torch.Tensor, positions: torch.Tensor, tables=None):
        """Fresh ``(q, k, v)`` of ``layer`` for hidden inputs ``h`` at ``positions``.

        Shapes ``(n, heads, head_dim)`` / ``(n, kv_heads, head_dim)``, after q/k norm and RoPE.
        ``tables`` (from ``rope_tables(positions)``) saves recomputing the rotation tables.
        """
        return self._project(layer, h, positions, tables)

    def _project(self, layer: int, h: torch.Tensor, positions: torch.Tensor, tables=None):
        # ``project`` without entering inference mode again: a decode step calls it once per
        # layer from inside ``forward_batch``, where the context manager cost ~7 us a call.
        c, w = self.config, self.weights.layers[layer]
        tables = tables or self.rope_tables(positions, h.dtype)
        cos, sin = tables[c.layer_types[layer]]
        fused = self.backend.project_qkv(c, w, h, cos, sin)
        if fused is not None:
            return fused
        x = self._norm(h, w.attn_norm)
        qkv = self.backend.linear(x, w.wqkv, w.bqkv)
        n = h.shape[0]
        q = qkv[:, : self._q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, self._q_size : self._q_size + self._kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, self._q_size + self._kv_size :].view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self._norm(q, w.q_norm)
            k = self._norm(k, w.k_norm)
        return self.backend.rope(q, cos, sin), self.backend.rope(k, cos, sin), v

    @torch.inference_mode()
    def layer(
        self,
        layer: int,
        h: torch.Tensor,
        cache: KVCache,
        slots: slice | torch.Tensor,
        kv_len: int | None = None,
        keys_sorted: bool | None = None,
        tables=None,
        outputs: slice | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``layer`` for the tokens whose hidden inputs are ``h`` and whose cache slots are ``slots``.

        Their fresh K/V overwrite ``cache.kv[layer]`` at ``slots`` (positions are read from
        ``cache.positions[slots]``, which the caller has set); their queries then attend to slots
        ``[0, kv_len)`` (default ``cache.length``) with the position mask. Returns the layer's
        output hidden states for those tokens. ``tables``: see ``project``.

        ``outputs`` selects the rows of ``h`` whose outputs are wanted (default: all; a slice or
        sorted row indices). K/V are written for every row either way, but attention and the MLP
        run only for the selected rows: the last layer of a prefill needs the output of its last
        token alone, and CacheBlend recomputes only the tokens it selected. The two halves are
        ``write_kv`` and ``attend_mlp``, for callers that look at the fresh K/V in between.
        """
        q = self.write_kv(layer, h, cache, slots, tables)
        return self.attend_mlp(layer, q, h, cache, slots, kv_len, keys_sorted, outputs)

    @torch.inference_mode()
    def write_kv(
        self, layer: int, h: torch.Tensor, cache: KVCache, slots: slice | torch.Tensor, tables=None
    ) -> torch.Tensor:
        """The first half of ``layer``: project ``h`` (tokens at ``slots``), write their fresh K/V
        into the cache, and return their queries ``(n, heads, head_dim)``."""
        q, k, v = self._project(layer, h, cache.positions[slots], tables)
        cache.kv[layer, 0][:, slots] = k.transpose(0, 1).to(cache.dtype)
        cache.kv[layer, 1][:, slots] = v.transpose(0, 1).to(cache.dtype)
        return q

    @torch.inference_mode()
    def attend_mlp(
        self,
        layer: int,
        q: torch.Tensor,
        h: torch.Tensor,
        cache: KVCache,
        slots: slice | torch.Tensor,
        kv_len: int | None = None,
        keys_sorted: bool | None = None,
        rows: slice | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The second half of ``layer``: attention of the queries ``q`` (tokens at ``slots``, inputs
        ``h``) over slots ``[0, kv_len)`` by position, then the MLP; only for ``rows`` if given."""
        c = self.config
        kv_len = cache.length if kv_len is None else kv_len
        q_pos = cache.positions[slots]
        if rows is not None:
            q, q_pos, h = q[rows], q_pos[rows], h[rows]
            if h.shape[0] == 0:
                return h
        if keys_sorted is None:
            keys_sorted = cache.keys_sorted(kv_len)
        attn = attend(
            q.transpose(0, 1),
            cache.kv[layer, 0, :, :kv_len],
            cache.kv[layer, 1, :, :kv_len],
            q_pos,
            cache.positions[:kv_len],
            scale=c.scaling,
            window=c.window(layer),
            softcap=c.attn_logit_softcap,
            keys_sorted=keys_sorted,
        )
        return self.post_attention(layer, attn, h)

    def post_attention(self, layer: int, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The rest of ``layer`` after attention: output projection, residual, MLP, residual."""
        c, w, b = self.config, self.weights.layers[layer], self.backend
        fused = b.post_attention(c, w, attn, h)
        if fused is not None:
            return fused
        out = b.linear(attn, w.wo)
        if w.attn_out_norm is not None:
            out = self._norm(out, w.attn_out_norm)
        h, x = b.add_rms_norm(h, out, w.mlp_norm, c.rms_norm_eps)
        act = b.gated_act(b.linear(x, w.w_gate), b.linear(x, w.w_up), c.hidden_act)
        out = b.linear(act, w.w_down)
        if w.mlp_out_norm is not None:
            out = self._norm(out, w.mlp_out_norm)
        return h + out

    def rerotate_keys(
        self,
        layer: int,
        keys: torch.Tensor,
        from_positions: torch.Tensor,
        to_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Keys ``(n, kv_heads, head_dim)`` of ``layer`` rotated at ``from_positions``, moved to ``to_positions``."""
        return rope.rerotate(
            keys, from_positions, to_positions, self._freqs[self.config.layer_types[layer]]
        )

    @torch.inference_mode()
    def move_keys(self, cache: KVCache, start: int, end: int, to_start: int) -> None:
        """Move the keys in slots ``[start, end)`` of ``cache`` (contiguous positions) so that they
        start at position ``to_start``: one rotation by the shift, in place on the cache's device
        (values do not depend on position), and the slots' positions updated. Exact to float
        rounding: see ``rope``."""
        if not 0 <= start <= end <= cache.length:
            raise ValueError(
                f"slots [{start}, {end}) are outside the valid range [0, {cache.length})"
            )
        if end == start:
            return
        pos = cache.positions[start:end]
        if not torch.equal(
            pos, torch.arange(int(pos[0]), int(pos[0]) + end - start, device=pos.device)
        ):
            raise ValueError("move_keys needs contiguous positions in the moved slots")
        shift = to_start - int(pos[0])
        self.rotate_keys(cache, range(self.config.num_layers), start, end, shift)
        cache.positions[start:end] = pos + shift

    @torch.inference_mode()
    def rotate_keys(self, cache: KVCache, layers: range, start: int, end: int, shift: int) -> None:
        """Rotate the keys of ``layers`` in slots ``[start, end)`` by ``shift`` positions, in place;
        positions are left as they are (a caller loading layer by layer sets them once)."""
        if shift == 0 or end == start:
            return
        work = torch.promote_types(cache.dtype, torch.float32)
        delta = torch.tensor([shift], dtype=torch.int64, device=cache.device)
        tables = {}  # one rotation table per layer type (sliding and global layers have their own base)
        for layer in layers:
            kind = self.config.layer_types[layer]
            if kind not in tables:
                tables[kind] = rope.cos_sin(self._freqs[kind], delta, work)
            cos, sin = tables[kind]
            keys = cache.kv[layer, 0, :, start:end]  # (kv_heads, n, head_dim), a view
            keys.copy_(rope.apply(keys.transpose(0, 1).to(work), cos, sin).transpose(0, 1))
