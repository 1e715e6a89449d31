"""The live KV cache of one sequence, as the model runner reads and writes it, and the budget that
bounds the live KV of every sequence together.

Layout: one contiguous buffer per sequence (not a paged block pool). Attention then reads each
sequence's keys as one view, with no gather per step; in pure PyTorch a block pool has to copy
every sequence's blocks into one tensor at every layer of every step (``bench/kv_layout.py``:
the attention of a 16-sequence decode step took ~1.4x as long paged, ~1.8x padded into one batched
call). The price is that a cache is allocated with some headroom and grows by reallocating
(~13% more memory reserved than a 16-token-block pool in that benchmark); ``KVBudget`` counts
both buffers while a cache grows, so the budget is never exceeded, even transiently.

A buffer's bytes go back to the budget when the buffer itself is freed (a finalizer on the
tensor), not when its sequence ends: the saver thread may still be copying a finished
sequence's spans out of it, and until then that memory is in use.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..kv.chunk import KVChunk
from .config import ModelConfig


class OutOfKVMemory(MemoryError):
    """The KV budget cannot hold what a cache asked for (the engine preempts or waits)."""


class KVBudget:
    """Bytes of live KV that caches may hold together (``limit`` None: unbounded, still counted).

    Every ``KVCache`` given this budget takes its buffer's bytes before allocating and gives them
    back when released or regrown. ``used`` never exceeds ``limit``; ``peak`` is the highest
    ``used`` seen (what tests assert on)."""

    def __init__(self, limit: int | None = None):
        if limit is not None and limit <= 0:
            raise ValueError(f"a KV budget must be > 0 bytes, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes``; False (nothing taken) if that would exceed the limit."""
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self.used:
                raise RuntimeError(
                    f"giving back {nbytes} bytes of KV but only {self.used} are taken"
                )
            self.used -= nbytes

    @property
    def free(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def fits(self, nbytes: int) -> bool:
        return self.limit is None or nbytes <= self.limit - self.used


def slot_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one slot of a ``KVCache`` takes: K and V of every layer, and its position."""
    c = config
    return (
        c.num_layers
        * 2
        * c.num_kv_heads
        * c.head_dim
        * torch.tensor([], dtype=dtype).element_size()
        + 8
    )


class KVCache:
    """KV buffers of one sequence: ``kv`` is ``(layers, 2, kv_heads, capacity, head_dim)``.

    Slots ``[0, length)`` are valid; ``positions[i]`` is the absolute position slot ``i`` was
    rotated at. Head-major storage keeps each head's keys contiguous for attention; chunks
    (``KVChunk``) use the token-major layout of the storage format, converted at the boundary.
    ``kv`` may be stored in a narrower dtype than the compute dtype (fp16 KV, fp32 compute): the
    runner always writes K/V here first and attends to what is stored, so a prefill and a cache
    hit see exactly the same numbers.
    """

    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        budget: KVBudget | None = None,
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self.budget = budget
        self.slot_bytes = slot_bytes(config, dtype)
        self._give_back: weakref.finalize | None = None
        self.kv, self.positions = self._alloc(max(capacity, 1))

    def _alloc(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers for ``capacity`` slots, their bytes taken from the budget first
        (OutOfKVMemory if it cannot) and given back when the buffer is freed."""
        nbytes = capacity * self.slot_bytes
        if self.budget is not None and not self.budget.take(nbytes):
            raise OutOfKVMemory(
                f"{capacity} KV slots ({nbytes} bytes) do not fit the KV budget "
                f"({self.budget.used} of {self.budget.limit} bytes in use)"
            )
        c = self.config
        try:
            # Never inference tensors (even when the runner grows a cache inside inference mode):
            # callers outside inference mode write into caches too (loads, tests).
            with torch.inference_mode(False):
                kv = torch.empty(
                    c.num_layers,
                    2,
                    c.num_kv_heads,
                    capacity,
                    c.head_dim,
                    dtype=self.dtype,
                    device=self.device,
                )
                positions = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        except BaseException:
            if self.budget is not None:
                self.budget.give(nbytes)
            raise
        if self.budget is not None:
            self._give_back = weakref.finalize(kv, self.budget.give, nbytes)
        return kv, positions

    def release(self) -> None:
        """Drop the buffers and give their bytes back to the budget now, even if something still
        refers to them (a failed request's traceback). The cache is empty afterwards."""
        if self._give_back is not None:
            self._give_back()  # runs once: the finalizer is dead afterwards
            self._give_back = None
        c = self.config  # new empty tensors: a view would keep the old storage alive
        self.length = 0
        self.kv = torch.empty(
            c.num_layers, 2, c.num_kv_heads, 0, c.head_dim, dtype=self.dtype, device=self.device
        )
        self.positions = torch.zeros(0, dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def fork(self, capacity: int = 0) -> KVCache:
        """A new cache holding a copy of this one's valid slots, with room for at least
        ``capacity`` slots, its bytes taken from the same budget (OutOfKVMemory if they do not
        fit): a request's ``n`` choices each continue the prompt's KV in a copy of their own."""
        out = KVCache(self.config, max(capacity, self.length), self.dtype, self.device, self.budget)
        out.kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        out.positions[: self.length] = self.positions[: self.length]
        out.length = self.length
        return out

    def reserve(self, total: int) -> None:
        """Make room for ``total`` slots, keeping the valid ones. Grows by at least a quarter (a
        few reallocations over a long answer), or exactly to ``total`` when the budget cannot hold
        more; OutOfKVMemory if it cannot hold that either."""
        if total <= self.capacity:
            return
        try:
            kv, positions = self._alloc(max(total, self.capacity + max(64, self.capacity // 4)))
        except OutOfKVMemory:
            kv, positions = self._alloc(total)
        kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        positions[: self.length] = self.positions[: self.length]
        self.kv, self.positions = kv, positions  # the old buffers' bytes go back as they are freed

    def keys_sorted(self, upto: int) -> bool:
        p = self.positions[:upto]
        return upto < 2 or bool((p[1:] >= p[:-1]).all())

    @property
    def next_position(self) -> int:
        """One past the highest position held (slots need not be in position order)."""
        return int(self.positions[: self.length].max()) + 1 if self.length else 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def chunk(self, start: int, end: int) -> KVChunk:
        """A contiguous copy of slots ``[start, end)`` in the chunk layout, on the CPU."""
        if not 0 <= start < end <= self.length:
            raise ValueError(
                f"slots [{start}, {end}) are outside the valid range [0, {self.length})"
            )
        kv = self.kv[:, :, :, start:end].transpose(2, 3).to("cpu", copy=True).contiguous()
        return KVChunk(kv=kv, positions=self.positions[start:end].to("cpu", copy=True))

    def write(
        self, start: int, kv: torch.Tensor, positions: torch.Tensor, first_layer: int = 0
    ) -> None:
        """Put ``kv`` (chunk layout ``(layers, 2, tokens, kv_heads, head_dim)``, any device) into slots
        ``[start, start + tokens)`` of layers ``first_layer..``, at ``positions``; the valid slots
        grow to cover them. Keys are taken as they are: moving them is ``Transformer.move_keys``."""
        c = self.config
        n_layers, _, n, heads, dim = kv.shape
        if (
            kv.dim() != 5
            or kv.shape[1] != 2
            or (heads, dim) != (c.num_kv_heads, c.head_dim)
            or not 0 <= first_layer <= first_layer + n_layers <= c.num_layers
        ):
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} at layer {first_layer} does not fit this model's KV "
                f"({c.num_layers} layers, {c.num_kv_heads} heads, dim {c.head_dim})"
            )
        if positions.shape != (n,):
            raise ValueError(f"{n} tokens but positions of shape {tuple(positions.shape)}")
        if not 0 <= start <= self.length:
            raise ValueError(f"slot {start} would leave a gap after the {self.length} valid slots")
        end = start + n
        self.reserve(end)
        self.kv[first_layer : first_layer + n_layers, :, :, start:end] = kv.transpose(2, 3).to(
            self.device, self.dtype
        )
        self.positions[start:end] = positions.to(self.device)
        self.length = max(self.length, end)

    def write_layers(self, start: int, kv: torch.Tensor, first_layer: int) -> None:
        """Put the KV of layers ``first_layer..`` (chunk layout) into reserved slots ``start..``,
        leaving positions and the valid length alone: for loading layer by layer into slots whose
        positions were set once, while other layers are in use."""
        n = kv.shape[2]
        if start + n > self.capacity or first_layer + kv.shape[0] > self.config.num_layers:
            raise ValueError(
                f"layers {first_layer}.. of slots [{start}, {start + n}) are outside this cache"
            )
        self.kv[first_layer : first_layer + kv.shape[0], :, :, start : start + n] = kv.transpose(
            2, 3
        ).to(self.device, self.dtype)
