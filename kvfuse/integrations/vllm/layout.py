"""Where K and V lie inside vLLM's paged KV blocks, learned from vLLM itself, and conversions.

vLLM hands a connector one tensor per attention layer, a *standardized* ``[B, H', N, C']`` view
(blocks first; any physical layout: vLLM logs it as LBHNC, LBNHC, ...), but how a token's K and V
are packed inside a block depends on the attention backend:

- CPU_ATTN (``vec``/``vec16`` kernels): ``[B, H, N, 2 * D]`` read as ``[B, H, 2N, D]``: per head a
  K plane stored transposed (``[D, N]``), then a V plane ``[N, D]``;
- FLASH_ATTN, TRITON_ATTN: ``C' = 2D``, K in the first ``D`` channels of a token, V in the rest;
- FLASHINFER: ``H' = 2H``, the K heads then the V heads;
- CPU ``amx`` kernels: quad-word packed K and V tiles; other backends: their own.

Rather than a table of these (which a new vLLM version or CPU ISA would silently break), the
connector asks vLLM's own writer: ``probe_layout`` makes the layer's attention backend write known
values (``impl.do_kv_cache_update``, what the forward pass uses) into one block, reads the block
back and derives, for every ``(K|V, token, head, dim)``, its position inside the block. A writer
that does not produce exactly one position per value (a quantized cache, a backend whose packing
loses or duplicates values) is a ``LayoutError`` with the reason; nothing is ever guessed.

``BlockLayout.gather`` / ``scatter`` then convert whole blocks between vLLM's view and kvfuse's
chunk layout ``(2, tokens, kv_heads, head_dim)`` (one layer), copying block pages and permuting
with one index: bit-exact both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Probe values are small integers (exact in every float type: bf16 holds integers up to 256):
# each coordinate is written in base 128 digits, K as +(digit + 1), V as -(digit + 1).
_BASE = 128

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """vLLM's KV cache layout is not one kvfuse can read exactly."""


@dataclass(frozen=True)
class BlockLayout:
    """The position of every ``(K|V, token, head, dim)`` of a block inside one block of a layer's
    ``[B, H', N, C']`` view: ``index[kind, t, h, d]`` is a flat offset into the block's ``H' * N *
    C'`` elements (logical order, whatever the physical strides)."""

    block_shape: tuple[int, int, int]  # (H', N, C') of one (kernel) block of the view
    kv_heads: int
    head_dim: int
    index: torch.Tensor  # int64 (2, N, kv_heads, head_dim)
    dense: bool  # every element of a block is a K or V value (no padding)

    @property
    def block_tokens(self) -> int:
        return self.block_shape[1]

    @property
    def block_elements(self) -> int:
        h, n, c = self.block_shape
        return h * n * c

    def _check_view(self, view: torch.Tensor) -> None:
        if view.dim() != 4 or tuple(view.shape[1:]) != self.block_shape:
            raise LayoutError(
                f"a KV cache view of shape {tuple(view.shape)} does not match the probed layout "
                f"[B, {', '.join(map(str, self.block_shape))}]"
            )

    @property
    def strides(self) -> tuple[tuple[int, int, int, int] | None, tuple[int, int, int, int] | None]:
        """Per kind (K, V): ``(offset, token stride, head stride, dim stride)`` inside a block when
        its positions are affine (every layout vLLM has but CPU-AMX), else None."""
        return _affine_strides(self.index[0]), _affine_strides(self.index[1])

    def gather(
        self, view: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The KV of ``blocks`` (kernel block indices, in token order) as ``(2, len(blocks) * N,
        kv_heads, head_dim)`` (into ``out`` if given): a copy, on the view's device, in its dtype."""
        self._check_view(view)
        nb, n, h, d = blocks.numel(), self.block_tokens, self.kv_heads, self.head_dim
        if out is None:
            out = torch.empty(2, nb * n, h, d, dtype=view.dtype, device=view.device)
        elif tuple(out.shape) != (2, nb * n, h, d) or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous (2, {nb * n}, {h}, {d}) tensor, got {tuple(out.shape)}"
            )
        pages = view.index_select(0, blocks.to(view.device)).reshape(nb, self.block_elements)
        for kind, aff in enumerate(self._strides):
            dst = out[kind].view(nb, n, h, d)
            if aff is not None:  # a strided copy
                base, st, sh, sd = aff
                _copy_along(
                    dst,
                    pages.as_strided(
                        (nb, n, h, d),
                        (self.block_elements, st, sh, sd),
                        pages.storage_offset() + base,
                    ),
                    (st, sh, sd),
                )
            else:  # a gather
                idx = self._index_on(view.device)[kind].reshape(-1)
                dst.copy_(pages.index_select(1, idx).view(nb, n, h, d))
        return out

    def scatter(self, view: torch.Tensor, blocks: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ``(2, len(blocks) * N, kv_heads, head_dim)`` into ``blocks`` of the view
        (whole blocks; a padded layout keeps its padding)."""
        self._check_view(view)
        nb, n, h, d = blocks.numel(), self.block_tokens, self.kv_heads, self.head_dim
        if tuple(kv.shape) != (2, nb * n, h, d):
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} for {nb} blocks of {n} tokens; expected "
                f"(2, {nb * n}, {h}, {d})"
            )
        if kv.dtype != view.dtype:
            raise ValueError(f"KV dtype {kv.dtype} does not match the cache's {view.dtype}")
        blocks = blocks.to(view.device)
        kv = kv.to(view.device)
        if self.dense:
            pages = torch.empty(nb, self.block_elements, dtype=view.dtype, device=view.device)
        else:  # keep what the padding holds
            pages = view.index_select(0, blocks).reshape(nb, self.block_elements)
        for kind, aff in enumerate(self._strides):
            src = kv[kind].reshape(nb, n, h, d)
            if aff is not None:
                base, st, sh, sd = aff
                _copy_along(
                    pages.as_strided(
                        (nb, n, h, d),
                        (self.block_elements, st, sh, sd),
                        pages.storage_offset() + base,
                    ),
                    src,
                    (st, sh, sd),
                )
            else:
                idx = self._index_on(view.device)[kind].reshape(-1)
                pages.index_copy_(1, idx, src.reshape(nb, -1))
        view.index_copy_(0, blocks, pages.view(nb, *self.block_shape))

    @property
    def _strides(self):
        got = self.__dict__.get("_strides_cache")
        if got is None:
            got = self.strides
            object.__setattr__(self, "_strides_cache", got)
        return got

    def _index_on(self, device: torch.device) -> torch.Tensor:
        cache = self.__dict__.setdefault("_index_cache", {})
        if device not in cache:
            cache[device] = self.index.to(device)
        return cache[device]

    def describe(self) -> str:
        """Where K and V lie, e.g. ``K[t,h,d] at h*8192 + d*128 + t, V[t,h,d] at h*8192 + 4096 +
        t*64 + d`` (an affine form when there is one)."""
        return ", ".join(
            f"{name}[t,h,d] at {_affine(self.index[kind])}" for kind, name in ((0, "K"), (1, "V"))
        )


def _copy_along(dst: torch.Tensor, src: torch.Tensor, strides: tuple[int, int, int]) -> None:
    """``dst.copy_(src)`` for ``(blocks, tokens, heads, dims)`` tensors, iterating in the memory
    order of the block's strided side (``strides`` of tokens, heads, dims): a transposed K plane
    copies ~30% faster that way."""
    order = [1 + i for i in sorted(range(3), key=lambda i: -abs(strides[i]))]
    dst.permute(0, *order).copy_(src.permute(0, *order))


def _affine_strides(index: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(base, st, sh, sd)`` with ``index[t, h, d] == base + t*st + h*sh + d*sd``, or None."""
    n, h, d = index.shape
    base = int(index[0, 0, 0])
    st = int(index[1, 0, 0]) - base if n > 1 else 0
    sh = int(index[0, 1, 0]) - base if h > 1 else 0
    sd = int(index[0, 0, 1]) - base if d > 1 else 0
    grid = (
        base
        + torch.arange(n)[:, None, None] * st
        + torch.arange(h)[None, :, None] * sh
        + torch.arange(d)[None, None, :] * sd
    )
    return (base, st, sh, sd) if torch.equal(grid, index.cpu()) else None


def _affine(index: torch.Tensor) -> str:
    """``index`` (N, H, D) as ``base + t*st + h*sh + d*sd`` if it is affine, else 'a permutation'."""
    aff = _affine_strides(index)
    if aff is None:
        return "a non-affine permutation"
    base, st, sh, sd = aff
    terms = [f"{v}*{s}" if s != 1 else v for v, s in (("h", sh), ("t", st), ("d", sd)) if s]
    order = sorted(zip((sh, st, sd), terms), key=lambda x: -abs(x[0]))
    text = " + ".join(t for _, t in order)
    return f"{base} + {text}" if base else text


def probe_layout(
    view: torch.Tensor, write: Writer, kv_heads: int, head_dim: int, block: int = 0
) -> BlockLayout:
    """Learn the block layout of one layer's ``[B, H', N, C']`` view from ``write(key, value,
    slot_mapping)``, the backend's own KV writer (``key``/``value``: ``(N, kv_heads, head_dim)``
    in the view's dtype; ``slot_mapping``: int64 slots, here those of kernel block ``block``).

    Block ``block`` is restored afterwards; call it before the cache is in use. LayoutError when
    the writer does not place every value exactly once, or changes the values."""
    _check_probed_view(view)
    _, hp, n, cp = view.shape
    coords = {"token": n, "head": kv_heads, "dim": head_dim}
    device = view.device
    saved = view[block].clone()
    slots = torch.arange(block * n, (block + 1) * n, dtype=torch.int64, device=device)
    grids = {
        "token": torch.arange(n, device=device)[:, None, None].expand(n, kv_heads, head_dim),
        "head": torch.arange(kv_heads, device=device)[None, :, None].expand(n, kv_heads, head_dim),
        "dim": torch.arange(head_dim, device=device)[None, None, :].expand(n, kv_heads, head_dim),
    }
    found: dict[str, torch.Tensor] = {}
    kind: torch.Tensor | None = None
    try:
        for name, size in coords.items():
            value = torch.zeros(hp * n * cp, dtype=torch.int64, device=device)
            digits = 1 if size <= _BASE else 2
            for digit in range(digits):
                part = (grids[name] // (_BASE**digit)) % _BASE + 1
                read = _probe_write(view[block], write, part, slots)
                sign = torch.sign(read).to(torch.int8)
                if kind is None:
                    kind = sign
                elif not torch.equal(kind, sign):
                    raise LayoutError(
                        "the backend placed K and V differently on two writes of the same slots"
                    )
                value += (read.abs().to(torch.int64) - 1).clamp(min=0) * (_BASE**digit)
            found[name] = value
    finally:
        view[block].copy_(saved)
    assert kind is not None
    return _index_from_probe(kind, found, (hp, n, cp), kv_heads, head_dim)


def _check_probed_view(view: torch.Tensor) -> None:
    """A view ``probe_layout`` can learn from: 4-D, of a float dtype of at least 16 bits (the
    probe's values are small integers, which such a dtype holds exactly)."""
    if view.dim() != 4:
        raise LayoutError(
            f"expected a 4-D [blocks, heads, block_size, content] view, got shape {tuple(view.shape)}"
        )
    if not view.dtype.is_floating_point or view.element_size() < 2:
        raise LayoutError(
            f"the KV cache holds {view.dtype}; kvfuse reads float16, bfloat16 and float32 caches only "
            "(start vLLM with --kv-cache-dtype auto)"
        )


def _probe_write(
    block: torch.Tensor, write: Writer, part: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One probe: ``write`` K = ``part`` and V = ``-part`` (``(tokens, heads, dims)``, values 1 to
    ``_BASE``) into the zeroed ``block`` at ``slots``; the block's contents read back, flat, as
    float64. LayoutError when the writer fails or the values do not come back as written."""
    n, kv_heads, head_dim = part.shape
    block.zero_()
    try:
        write(part.to(block.dtype), (-part).to(block.dtype), slots)
    except Exception as e:
        raise LayoutError(
            f"the attention backend's KV writer failed on a probe of {n} tokens x "
            f"{kv_heads} heads x {head_dim} dims: {e}"
        ) from e
    read = block.reshape(-1).to(torch.float64)
    if not torch.equal(read, read.round()) or read.abs().max() > _BASE:
        raise LayoutError(
            "the backend changed the values it wrote (a quantized or transformed KV cache); "
            "kvfuse needs a plain float16/bfloat16/float32 cache"
        )
    return read


def _index_from_probe(
    kind: torch.Tensor,
    found: dict[str, torch.Tensor],
    block_shape: tuple[int, int, int],
    kv_heads: int,
    head_dim: int,
) -> BlockLayout:
    n = block_shape[1]
    total = n * kv_heads * head_dim
    index = torch.empty(2, total, dtype=torch.int64)
    for k, sign in ((0, 1), (1, -1)):
        pos = torch.nonzero(kind.cpu() == sign).reshape(-1)
        if pos.numel() != total:
            what = "K" if k == 0 else "V"
            raise LayoutError(
                f"the backend wrote {pos.numel()} {what} values into a block, expected {total} "
                f"({n} tokens x {kv_heads} heads x {head_dim} dims): not a layout kvfuse can read"
            )
        t, h, d = (found[c].cpu()[pos] for c in ("token", "head", "dim"))
        if int(t.max()) >= n or int(h.max()) >= kv_heads or int(d.max()) >= head_dim:
            raise LayoutError("the backend wrote values at coordinates outside the block")
        flat = (t * kv_heads + h) * head_dim + d
        if not torch.equal(
            torch.bincount(flat, minlength=total), torch.ones(total, dtype=torch.int64)
        ):
            raise LayoutError(
                "the backend wrote some (token, head, dim) twice and others not at all"
            )
        index[k, flat] = pos
    dense = 2 * total == block_shape[0] * block_shape[1] * block_shape[2]
    return BlockLayout(block_shape, kv_heads, head_dim, index.view(2, n, kv_heads, head_dim), dense)
