"""One batched step over several sequences: what ``Transformer.forward_batch`` prepares once per
step and then uses in every layer.

A step runs the dense parts (projections, MLP, vocabulary) once over all the step's tokens; what
stays per sequence is where its fresh K/V go and what its queries attend to. ``BatchStep`` holds
that per-sequence part:

- ``write_kv``: the fresh K/V rows into each sequence's own buffer (one kernel call per layer on
  the CPU, else one copy per sequence);
- ``attend``: the attention of every row. Sequences with a few new tokens (decoding, the usual
  case) go through the batched CPU kernel (``cpu/kernels``, where the runner's backend chose the
  kernels: ``CpuBackend.step_kernel``): one call per layer for all of them,
  reading each buffer in place in its stored dtype. Sequences with more tokens (prefill chunks)
  keep PyTorch's SDPA, split by ``attention.plan`` once per step: for many queries its blocked
  matmuls beat a per-query loop. Both use the same position mask, so a sequence gets the same
  numbers (up to float rounding) whichever path it takes, and the same as ``forward``.

At the last layer only the rows whose logits are wanted are computed (``last_rows``). When every
sequence takes the kernel (``stacked``), ``run_stack`` runs all the layers in one kernel call
(``cpu/kernels/stack.cpp``) instead of the runner's per-layer loop over ``write_kv`` and ``attend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import attention
from .cache import KVCache

# Sequences with at most this many new tokens may use the kernel: it loops over queries, which
# wins for a handful (decode steps, short appends) and loses to SDPA's blocked matmuls for a long
# chunk. Beyond KERNEL_FEW_QUERIES, only while queries x keys stay under KERNEL_MAX_SCORES: the
# kernel reads a sequence's KV once per query, so over a long history a few dozen queries run
# faster through SDPA (SmolLM2, fp16 KV, 2 cores, a whole step: 16 queries over 1,800 keys 142 ms
# in the kernel vs 76 ms with SDPA; 4 queries 59 vs 55 ms; 2 queries 43 vs 55 ms).
KERNEL_MAX_QUERIES = 16
KERNEL_FEW_QUERIES = 4
KERNEL_MAX_SCORES = 4096


def kernel_fits(queries: int, keys: int) -> bool:
    """Whether a sequence with ``queries`` new tokens over ``keys`` visible slots should take the
    attention kernel rather than SDPA (see the constants above)."""
    if queries > KERNEL_MAX_QUERIES:
        return False
    return queries <= KERNEL_FEW_QUERIES or queries * keys <= KERNEL_MAX_SCORES


@dataclass(frozen=True)
class Span:
    """One sequence of the step: rows ``[row0, row1)`` of the step's tokens go to slots ``slot0..``
    of ``cache``; its queries see slots ``[0, kv_len)``."""

    cache: KVCache
    row0: int
    row1: int
    slot0: int
    kv_len: int
    positions: torch.Tensor
    logits: bool
    plans: dict | None = None  # window -> attention parts, for the SDPA path
    last_plans: dict | None = None  # the same for its last row alone (the last layer)


@dataclass
class BatchStep:
    """The per-sequence part of one batched step (see the module docstring)."""

    spans: list[Span]
    kernel: object | None  # the compiled kernel module, or None
    windows: dict[int, int | None]  # layer -> sliding window
    scale: float
    softcap: float | None
    _kv: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        self._kv = [s.cache.kv for s in self.spans]
        self._kernel_spans = [i for i, s in enumerate(self.spans) if s.plans is None]
        self._row_args = self._kernel_args(last=False)
        self._last_args = self._kernel_args(last=True)
        self.last_rows = [s.row1 - 1 for s in self.spans if s.logits]
        self._out_rows = {last: self._out_index(last) for last in (False, True)}
        # The kernels' per-sequence arguments, the same in every layer: built once per step.
        self._write_args = (
            [s.row0 for s in self.spans],
            [s.slot0 for s in self.spans],
            [s.row1 - s.row0 for s in self.spans],
        )
        self._positions = [s.cache.positions for s in self.spans]
        self._lens = [s.kv_len for s in self.spans]

    # ----------------------------------------------------------------------------------- K/V

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put rows of ``k``/``v`` ``(n, kv_heads, head_dim)`` into each sequence's slots at ``layer``."""
        if self.kernel is not None and k.dtype == torch.float32:
            self.kernel.write_kv(self._kv, layer, k, v, *self._write_args)
            return
        for s, kv in zip(self.spans, self._kv):
            kv[layer, 0, :, s.slot0 : s.slot0 + s.row1 - s.row0] = k[s.row0 : s.row1].transpose(
                0, 1
            )
            kv[layer, 1, :, s.slot0 : s.slot0 + s.row1 - s.row0] = v[s.row0 : s.row1].transpose(
                0, 1
            )

    # ---------------------------------------------------------------------------- all layers

    @property
    def stacked(self) -> bool:
        """Whether every layer of this step can run as one ``run_stack`` call: the kernel module is
        in use and every sequence takes the attention kernel (decode steps, short appends)."""
        return self.kernel is not None and len(self._kernel_spans) == len(self.spans)

    def run_stack(
        self, stack, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Every layer of the step in one kernel call (``cpu/kernels/stack.cpp``) over the embedded
        tokens ``h``; ``tables``: (cos, sin) per rope kind, in the order the stack was built with.
        Returns the hidden states of ``last_rows`` after the last layer."""
        _, q_seq, q_pos = self._row_args
        if self._last_args is None:
            last_rows, last_seq, last_pos = torch.empty(0, dtype=torch.int64), [], []
        else:
            last_rows, last_seq, last_pos = self._last_args
        return self.kernel.run_stack(
            stack,
            h,
            self._kv,
            self._positions,
            self._lens,
            q_seq,
            q_pos,
            *self._write_args,
            [c for c, _ in tables],
            [s for _, s in tables],
            last_rows,
            last_seq,
            last_pos,
        )

    # ------------------------------------------------------------------------------ attention

    def attend(self, layer: int, q: torch.Tensor, last: bool) -> torch.Tensor:
        """Attention outputs ``(rows, heads * head_dim)`` of the queries ``q`` (every row of the step;
        at the ``last`` layer, the rows of ``last_rows`` in that order)."""
        window = self.windows[layer]
        rows = self.last_rows if last else None
        n_out = len(rows) if last else q.shape[0]
        kernel_out = self._kernel_attend(layer, q, window, last)
        if len(self._kernel_spans) == len(self.spans):
            return kernel_out  # every sequence took the kernel: already in row order
        out = q.new_empty(n_out, q.shape[1] * q.shape[2])
        row_of = {r: i for i, r in enumerate(rows)} if last else None
        if kernel_out is not None:
            out[self._out_rows[last]] = kernel_out
        for s in self.spans:
            if s.plans is None or (last and not s.logits):
                continue
            a = s.row1 - 1 if last else s.row0
            parts = (s.last_plans if last else s.plans)[window]
            kv = s.cache.kv
            res = attention.run(
                q[a : s.row1].transpose(0, 1),
                kv[layer, 0, :, : s.kv_len],
                kv[layer, 1, :, : s.kv_len],
                parts,
                scale=self.scale,
                softcap=self.softcap,
            )
            if last:
                out[row_of[a]] = res[0]
            else:
                out[a : s.row1] = res
        return out

    def _kernel_attend(
        self, layer: int, q: torch.Tensor, window: int | None, last: bool
    ) -> torch.Tensor | None:
        if not self._kernel_spans:
            return None
        args = self._last_args if last else self._row_args
        if args is None:
            return None
        rows, q_seq, q_pos = args
        if rows is not None:
            q = q[rows]
        return self.kernel.attend(
            q,
            self._kv,
            self._positions,
            self._lens,
            q_seq,
            q_pos,
            layer,
            self.scale,
            window or 0,
            self.softcap or 0.0,
        )

    def _kernel_args(self, last: bool):
        """(rows of q to take or None for all, sequence index per row, position per row) of the
        kernel's queries; None when no query of this layer takes the kernel."""
        rows, q_seq, q_pos = [], [], []
        for i in self._kernel_spans:
            s = self.spans[i]
            if last and not s.logits:
                continue
            a = s.row1 - 1 if last else s.row0
            rows.extend(range(a, s.row1))
            q_seq.extend([i] * (s.row1 - a))
            q_pos.extend(s.positions[a - s.row0 :].tolist())
        if not rows:
            return None
        every = not last and len(self._kernel_spans) == len(self.spans)  # q as it is, no gather
        return (None if every else torch.tensor(rows)), q_seq, q_pos

    def _out_index(self, last: bool) -> torch.Tensor | None:
        """Where the kernel's rows go in ``attend``'s output (computed once per step)."""
        args = self._last_args if last else self._row_args
        if args is None or args[0] is None:
            return None  # no kernel rows, or all of them in order
        rows = args[0]
        if not last:
            return rows
        where = {r: i for i, r in enumerate(self.last_rows)}
        return torch.tensor([where[int(r)] for r in rows])


def prepare(runner, items) -> tuple[BatchStep, torch.Tensor]:
    """Validate ``items`` (``transformer.BatchItem``), reserve their slots and set their positions;
    return the step and the positions of all its tokens, in row order."""
    c = runner.config
    windows = {layer: c.window(layer) for layer in range(c.num_layers)}
    kernel = runner.backend.step_kernel(it.cache.dtype for it in items)
    spans, row = [], 0
    for it in items:
        span = _span(runner, it, row, set(windows.values()), use_kernel=kernel is not None)
        spans.append(span)
        row = span.row1
    step = BatchStep(spans, kernel, windows, c.scaling, c.attn_logit_softcap)
    return step, torch.cat([s.positions for s in spans])


def _span(runner, it, row: int, windows: set, use_kernel: bool) -> Span:
    n = len(it.ids)
    if n == 0:
        raise ValueError("forward_batch() needs at least one token per item")
    cache = it.cache
    start = cache.length if it.start is None else it.start
    if not 0 <= start <= cache.length:
        raise ValueError(f"slot {start} would leave a gap after the {cache.length} valid slots")
    positions = it.positions
    if positions is None:
        nxt = cache.next_position
        positions = torch.arange(nxt, nxt + n, device=runner.device)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=runner.device).reshape(-1)
    if positions.shape[0] != n:
        raise ValueError(f"{n} tokens but {positions.shape[0]} positions")
    cache.reserve(start + n)
    cache.positions[start : start + n] = positions
    kv_len = max(cache.length, start + n)
    plans = last_plans = None
    if not (use_kernel and kernel_fits(n, kv_len)):
        k_pos = cache.positions[:kv_len]
        sorted_keys = cache.keys_sorted(kv_len)
        plans = {w: attention.plan(positions, k_pos, w, sorted_keys) for w in windows}
        last_plans = (
            {w: attention.plan(positions[-1:], k_pos, w, sorted_keys) for w in windows}
            if it.logits
            else None
        )
    return Span(cache, row, row + n, start, kv_len, positions, it.logits, plans, last_plans)
