"""Reduced-precision weights: one ``linear`` for every projection of the runner.

A weight is either a plain tensor (``F.linear``) or a packed object with a ``linear(x, bias)``
method (blocked or quantized weights); the runner calls ``linear`` and does not care which.

``weights: int8`` (``quantize_weights``) stores every projection (q/k/v, o, gate, up, down and
the vocabulary projection) as int8 with one symmetric scale per output channel. A decode step
reads a quarter of the fp32 weight bytes, which is what bounds single-stream decoding on a CPU.
Two implementations, with their own cache identity (``identity_of``: they compute slightly
different numbers, so their KV never mixes):

- where kvfuse's CPU kernels run (the usual case): ``packed.BlockedWeight`` in int8, widened
  to float32 in registers and multiplied with float32 activations: the only rounding is the
  weights'; faster than fbgemm at every row count measured (``bench/decode.py``);
- otherwise ``Int8Weight``: fbgemm's dynamic-quantized linear, which also rounds each call's
  input to 8 bits (with the per-token scales and split activations described there).

The embedding table stays in the compute dtype for lookups; when tied, the vocabulary projection
gets a packed copy of it. The norms stay as they are. CPU only: neither runs on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: Valid values of the ``weights`` setting: ``auto`` runs the weights as the file holds them (a
#: GGUF's own blocks on a CPU, ``models.ggml``; else the compute dtype), ``fp32`` in the compute
#: dtype (a GGUF dequantized once), ``int8`` as int8 projections.
WEIGHT_FORMATS = ("auto", "fp32", "int8")
#: What each int8 implementation adds to the model's fingerprint (``loader.fingerprint``): bump
#: the version whenever the numbers it computes change (rounding, packing, which parts are packed).
INT8_IDENTITY = {"blocked": "int8-rowwise-f32act-v1", "fbgemm": "int8-rowwise-split-v1"}

_ENGINES = ("x86", "fbgemm")  # engines whose packed dynamic linear is fbgemm's


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for a plain weight tensor or a packed (blocked or quantized) weight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w.linear(x, b)


class QuantizationUnavailable(ValueError):
    """int8 weights were asked for where PyTorch's quantized CPU kernels cannot run them."""


def check_int8_supported(device: torch.device | str = "cpu", fbgemm: bool = True) -> None:
    """Raise ``QuantizationUnavailable`` (naming the fix) unless int8 weights can run on ``device``.

    ``fbgemm``: whether the fbgemm implementation is the one to check (the loader says False where
    the backend runs int8 on kvfuse's kernels); selects an fbgemm-based quantized engine if another
    one is active."""
    device = torch.device(device)
    if device.type != "cpu":
        raise QuantizationUnavailable(
            f"weights: int8 runs on the CPU only (kvfuse's CPU kernels or PyTorch's fbgemm), not on {device}; "
            "use weights: auto on a GPU, or --device cpu"
        )
    if not fbgemm:
        return
    supported = torch.backends.quantized.supported_engines
    if not any(e in supported for e in _ENGINES):
        raise QuantizationUnavailable(
            "weights: int8 needs PyTorch's fbgemm quantized engine (x86 CPUs), which this PyTorch build lacks "
            f"(quantized engines: {', '.join(supported) or 'none'}); use weights: auto"
        )
    if torch.backends.quantized.engine not in _ENGINES:
        engine = next(e for e in _ENGINES if e in supported)
        log.info(
            "quantized engine %s -> %s for int8 weights", torch.backends.quantized.engine, engine
        )
        torch.backends.quantized.engine = engine


class Int8Weight:
    """A ``(out, in)`` weight as int8 with one symmetric scale per output row, packed for fbgemm.

    ``linear(x, bias)`` runs fbgemm's dynamic-quantized linear, which quantizes its input to 8
    bits with one (scale, zero point) per call and multiplies in integers. Two things keep that
    input rounding from costing accuracy:

    - *per-token scales*: rows of a multi-token input are first scaled to the same abs-max (and the
      outputs scaled back), so one token with massive activations (a sink at BOS, say) does not
      coarsen every other token's grid;
    - *split activations* (``split=True``, the default): the input's 8-bit rounding error is
      computed exactly (the same quantization fbgemm applies) and multiplied as a second row of
      the same call, scaled up into the same grid, so the activations are effectively ~16-bit while
      the weights are read once (see ``_split``). A decode step (one row) becomes a two-row
      product: the same weight bytes, a little more arithmetic. With ``split=False`` the input is
      rounded once to 8 bits: on SmolLM2 that decodes ~45% faster, but the greedy token agrees
      with fp32's at 92.4% of steps instead of 95.5%, KL 0.028 instead of 0.004
      (``bench/decode.py``).

    ``reduce_range`` (7-bit inputs) is needed where fbgemm multiplies with 16-bit pair sums that
    can saturate (x86 without VNNI); CPUs with AVX512-VNNI / AVX-VNNI use the full 8 bits
    (``default_reduce_range``).
    """

    __slots__ = ("packed", "shape", "reduce_range", "split", "row_sums")

    def __init__(self, weight: torch.Tensor, split: bool = True, reduce_range: bool | None = None):
        if weight.dim() != 2:
            raise ValueError(f"int8 weights must be 2-d (out, in), got shape {tuple(weight.shape)}")
        check_int8_supported(weight.device, fbgemm=True)
        w = weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        with (
            warnings.catch_warnings()
        ):  # "quantized tensor creation functions are deprecated" (once)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale, zeros, 0, torch.qint8)
            torch.quantize_per_tensor_dynamic(w[:1], torch.quint8, False)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.row_sums = q.dequantize().double().sum(dim=1).float()  # for split activations
        self.shape = tuple(w.shape)
        self.split = split
        self.reduce_range = default_reduce_range() if reduce_range is None else reduce_range

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: the int8 values and the per-row scales (float32)."""
        return self.shape[0] * self.shape[1] + 4 * self.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these int8 values stand for (for tests and measurements)."""
        w, _ = torch.ops.quantized.linear_unpack(self.packed)
        return w.dequantize()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        rows = x2.shape[0]
        row_max = None
        if rows > 1:  # per-token scales
            row_max = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
            x2 = x2 / row_max
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = (
            self._split(x2)
            if self.split
            else torch.ops.quantized.linear_dynamic(x2, self.packed, self.reduce_range)
        )
        if row_max is not None:
            y.mul_(row_max)
        if bias is not None:
            y.add_(bias)
        y = y.reshape(*lead, self.shape[0])
        return y if dtype == torch.float32 else y.to(dtype)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` with ``x`` as its 8-bit rounding plus the rounding error, in one call.

        fbgemm rounds ``x`` to a grid of ``levels`` steps over ``[min(x, 0), max(x, 0)]``; the
        error is at most about a step. Scaled up by ``gain`` and centred on the grid's middle
        ``c``, it fills the grid without reaching its ends, so the two-row input has the same
        range, fbgemm picks the same grid, and rounds the first row exactly as computed here.
        ``y = y_x + (y_err - c * sum(w)) / gain``: the error row's own rounding costs ``1/gain``
        of a single rounding."""
        q = torch.quantize_per_tensor_dynamic(x, torch.quint8, self.reduce_range)  # fbgemm's choice
        step, zero = q.q_scale(), q.q_zero_point()
        err = torch.sub(x, q.dequantize())
        worst = float(err.abs().max())
        if worst == 0.0:  # x is on the grid
            return torch.ops.quantized.linear_dynamic(x, self.packed, self.reduce_range)
        half = (127 if self.reduce_range else 255) / 2
        centre = (half - zero) * step
        gain = (half - 1) * step / worst
        err.mul_(gain).add_(centre)
        y = torch.ops.quantized.linear_dynamic(torch.cat([x, err]), self.packed, self.reduce_range)
        n = x.shape[0]
        return y[:n].add_(y[n:], alpha=1.0 / gain).sub_(self.row_sums, alpha=centre / gain)

    def __repr__(self) -> str:
        return f"Int8Weight(shape={self.shape}, split={self.split})"


@functools.lru_cache(maxsize=1)
def default_reduce_range() -> bool:
    """7-bit activations unless the CPU has VNNI (int8 dot products into 32 bits, no saturation).

    Read from ``/proc/cpuinfo`` (Linux); anywhere else the safe choice, 7 bits."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


def quantize_weights(
    weights,
    fmt: str = "int8",
    split: bool = True,
    reduce_range: bool | None = None,
    implementation: str | None = None,
    kernel=None,
):
    """A copy of ``weights`` (``transformer.Weights``) whose projections are int8.

    The input is not modified. ``fmt`` is a ``WEIGHT_FORMATS`` value (``auto`` and ``fp32`` return
    ``weights`` as it is). ``implementation`` is ``blocked`` (kvfuse's kernel, ``packed.BlockedWeight``, with
    the compiled module ``kernel``) or ``fbgemm`` (``Int8Weight``, with ``split`` and
    ``reduce_range``); default: ``blocked`` when given ``kernel``. Which one a model gets is
    ``cpu.backend``'s choice. The embedding table stays a plain tensor (``F.embedding`` looks rows
    up in it); a tied vocabulary projection (the same tensor) gets its own packed copy. Norms and
    biases stay.
    """
    from . import packed

    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {fmt!r}; use one of: {', '.join(WEIGHT_FORMATS)}")
    if fmt in ("auto", "fp32"):
        return weights
    if implementation is None:
        implementation = "blocked" if kernel is not None else "fbgemm"
    if implementation not in INT8_IDENTITY:
        raise ValueError(
            f"unknown int8 implementation {implementation!r}; use one of: {', '.join(INT8_IDENTITY)}"
        )

    def pack(w):
        if (
            isinstance(w, (Int8Weight, packed.BlockedWeight))
            and getattr(w, "fmt", "int8") == "int8"
        ):
            return w
        if implementation == "blocked":
            return packed.BlockedWeight(w, "int8", kernel=kernel)
        return Int8Weight(w, split, reduce_range)

    return packed.map_projections(weights, pack)


def identity_of(weights) -> str | None:
    """What ``weights`` add to the model's fingerprint: None for full-precision projections, else
    the ``INT8_IDENTITY`` of their int8 implementation (read from the vocabulary projection)."""
    from .packed import BlockedWeight

    w = weights.lm_head
    if isinstance(w, BlockedWeight) and w.fmt == "int8":
        return INT8_IDENTITY["blocked"]
    if isinstance(w, Int8Weight):
        return INT8_IDENTITY["fbgemm"]
    return None


def held_bytes(w) -> int:
    """Bytes one weight holds: a tensor's elements, a packed or block store's ``nbytes``; 0 for
    None."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(getattr(w, "nbytes", 0))


def weight_bytes(weights) -> dict[str, int]:
    """Bytes of weights a decode step reads, by part: ``layers`` (projections and norms),
    ``lm_head`` and ``final_norm`` (the embedding lookup reads one row, not counted)."""
    fields = [getattr(lw, f.name) for lw in weights.layers for f in dataclasses.fields(lw)]
    return {
        "layers": sum(held_bytes(w) for w in fields),
        "lm_head": held_bytes(weights.lm_head),
        "final_norm": held_bytes(weights.final_norm),
    }
