"""``CpuBackend``: the CPU path of one loaded model, chosen once, and the operations that run it.

Which operators a step runs (kvfuse's C++ kernels, ``kernels/``, or PyTorch's) and in which form
the projections are held (blocks for the kernels, oneDNN's packing, int8, plain tensors) used to
be decided wherever an operation ran: in the runner, the batched step, the weight packing, int8
quantization and the fingerprint, each time from the environment. ``select`` decides it once,
when a model loads, from the ``kernels`` setting (``auto``: the kernels where they build; ``on``:
required, an error where they cannot run; ``off``: PyTorch's operators only, for measurements)
and the model's device, compute dtype and ``weights`` setting. Then:

- ``pack`` puts the loaded weights in the chosen form (``WEIGHT_FORMS``);
- ``bind`` completes the choice for one runner: whether its activations go through the kernels
  (float32 on the CPU), whether each layer's two halves run as one call each (every projection
  in blocks) and the model's layers described once for the whole-stack decode call;
- the runner calls the operations (``linear``, the per-row ops, ``project_qkv`` /
  ``post_attention``, ``run_stack``, ``step_kernel``) and decides nothing itself. What still
  depends on one step (a tensor's dtype and layout, or how many queries over how many keys:
  ``batch.kernel_fits``) is checked by pure functions these operations apply.

Every path computes the same numbers up to float rounding; the kernels are faster
(``docs/benchmarks.md``). ``info`` names the choice for ``kvfuse models list``, the start-up log
line and ``/metrics``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from kvfuse.config import KERNEL_MODES, default_kernels

from .. import ggml, packed, pointwise, quant
from . import kernels

log = logging.getLogger(__name__)

#: The forms projections are held in: ``plain`` tensors (``F.linear``, in the compute dtype),
#: ``blocked-fp32`` / ``blocked-int8`` (``packed.BlockedWeight``, kvfuse's kernel),
#: ``onednn-fp32`` (``packed.PackedWeight``), ``fbgemm-int8`` (``quant.Int8Weight``) and
#: ``ggml`` (``ggml.GGMLWeight``: a GGUF file's own blocks, kvfuse's kernel).
WEIGHT_FORMS = ("plain", "blocked-fp32", "onednn-fp32", "blocked-int8", "fbgemm-int8", "ggml")
_PROJECTIONS = ("wqkv", "wo", "w_gate", "w_up", "w_down")
_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the attention kernel reads


class KernelsUnavailable(ValueError):
    """``kernels: on`` where kvfuse's CPU kernels cannot run (not built, or not on the CPU)."""


def select(
    mode: str | None, device: torch.device | str, dtype: torch.dtype, weights: str = "auto"
) -> CpuBackend:
    """The backend of a model on ``device`` in compute ``dtype`` with ``weights`` (``auto`` or
    ``int8``), for the ``kernels`` setting ``mode`` (None: ``$KVFUSE_KERNELS``, else ``auto``,
    for code that loads a model without a ``Config``: ``config.default_kernels``)."""
    mode = default_kernels() if mode is None else mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    device = torch.device(device)
    cpu32 = device.type == "cpu" and dtype == torch.float32
    kernel = _kernel(mode, device, cpu32, weights)
    return CpuBackend(mode, kernel, _form(mode, kernel, cpu32, weights), cpu32)


def _kernel(mode: str, device: torch.device, cpu32: bool, weights: str) -> ModuleType | None:
    """The kernel module where this model runs anything on it (float32 on the CPU, or int8
    weights there); not built otherwise, unless ``on`` requires it."""
    if mode == "off":
        return None
    if device.type != "cpu":
        if mode == "on":
            raise KernelsUnavailable(
                f"kernels: on runs kvfuse's CPU kernels, which do not run on {device}; "
                "use kernels: auto (or off)"
            )
        return None
    if mode == "auto" and not cpu32 and weights != "int8":
        return None
    module = kernels.get()
    if module is None and mode == "on":
        raise KernelsUnavailable(
            "kernels: on, but kvfuse's CPU kernels could not be built here (the warning above "
            "says why; python -m kvfuse.models.cpu.kernels tries again): install g++ and ninja, "
            "or use kernels: auto to run PyTorch's operators instead"
        )
    return module


def _form(mode: str, kernel: ModuleType | None, cpu32: bool, weights: str) -> str:
    """The projections' form: int8 in blocks where the kernels run, else fbgemm's; float32 on the
    CPU in blocks, else oneDNN's packing where PyTorch has it, unless the kernels are off (the
    plain PyTorch path, for measurements); plain tensors elsewhere."""
    if weights == "int8":
        return "blocked-int8" if kernel is not None else "fbgemm-int8"
    if not cpu32 or mode == "off":
        return "plain"
    if kernel is not None:
        return "blocked-fp32"
    return "onednn-fp32" if packed.onednn_available() else "plain"


def form_of(weights) -> str:
    """The ``WEIGHT_FORMS`` value ``weights`` (``transformer.Weights``) are in, read from the
    vocabulary projection (packed with the others)."""
    w = weights.lm_head
    if isinstance(w, ggml.GGMLWeight):
        return "ggml"
    if isinstance(w, packed.BlockedWeight):
        return "blocked-int8" if w.fmt == "int8" else "blocked-fp32"
    if isinstance(w, packed.PackedWeight):
        return "onednn-fp32"
    return "fbgemm-int8" if isinstance(w, quant.Int8Weight) else "plain"


@dataclass(frozen=True, eq=False)
class CpuBackend:
    """The choice (``select``), and once bound to a runner (``bind``) the operations it calls.

    ``kernel``: the compiled module, or None (PyTorch's operators only); ``weights``: the form of
    the projections (``WEIGHT_FORMS``); ``cpu32``: the model computes in float32 on the CPU, where
    the activation kernels apply. Set by ``bind``: ``ops`` (the module for activations, or None),
    ``fused`` (each layer's halves as one call) and ``stack`` (the whole-stack decode's layers)."""

    mode: str = "auto"
    kernel: ModuleType | None = None
    weights: str = "plain"
    cpu32: bool = False
    ops: ModuleType | None = None
    fused: bool = False
    stack: Any = None

    @property
    def ggml(self) -> bool:
        """Whether this backend runs a GGUF file's own blocks (``weights: auto`` on a float32 CPU
        model where the kernels run): the loader then keeps them instead of float32 copies."""
        return self.weights == "blocked-fp32" and self.kernel is not None

    @property
    def int8_implementation(self) -> str:
        """The int8 implementation (``quant.INT8_IDENTITY``) this backend packs int8 weights with."""
        return "blocked" if self.kernel is not None else "fbgemm"

    def info(self) -> dict[str, str]:
        """The choice in three labels: whether kvfuse's kernels run anything of this model, the
        weights' form, and the instruction set the kernels run with (``avx512`` where the CPU
        has it, else ``avx2``; ``none`` without them)."""
        on = self.ops is not None or self.weights.startswith("blocked") or self.weights == "ggml"
        isa = self.kernel.isa() if on and self.kernel is not None else "none"
        return {"kernels": "on" if on else "off", "weights": self.weights, "isa": isa}

    def describe(self) -> str:
        """The choice in words, for logs and listings."""
        i = self.info()
        isa = f", {i['isa'].upper()}" if i["isa"] != "none" else ""
        return f"kernels {i['kernels']}{isa} (kernels: {self.mode}), weights {i['weights']}"

    # --------------------------------------------------------------------------- the choice

    def pack(self, weights):
        """A copy of ``weights`` (``transformer.Weights``) in this backend's form. Float32
        projections that fail to pack stay plain tensors (logged; ``bind`` reports that form)."""
        if self.weights in ("blocked-int8", "fbgemm-int8"):
            return quant.quantize_weights(
                weights, "int8", implementation=self.int8_implementation, kernel=self.kernel
            )
        if self.weights == "plain":
            return weights
        try:
            if self.weights == "blocked-fp32":
                return packed.to_blocked(weights, self.kernel)
            return packed.to_onednn(weights)
        except (RuntimeError, ValueError) as exc:
            log.warning("keeping plain float32 weights: packing failed (%s)", exc)
            return weights

    def bind(self, config, weights, kinds: list[str], kernels: bool = True) -> CpuBackend:
        """This backend for a runner of ``config`` over ``weights`` (rope kinds in ``kinds``'
        order); ``kernels`` False keeps the activations on PyTorch's operators (the weights stay
        as they are)."""
        ops = self.kernel if kernels and self.cpu32 else None
        fused = ops is not None and all(
            isinstance(getattr(lw, f), (packed.BlockedWeight, ggml.GGMLWeight))
            for lw in weights.layers
            for f in _PROJECTIONS
        )
        stack = _build_stack(ops, config, weights, kinds) if fused else None
        return replace(self, weights=form_of(weights), ops=ops, fused=fused, stack=stack)

    # ----------------------------------------------------------------------- the operations

    def linear(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T + b`` whatever the weight's form (each form multiplies itself)."""
        return quant.linear(x, w, b)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return pointwise.rms_norm(x, weight, eps, self.ops)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        return pointwise.add_rms_norm(h, delta, weight, eps, self.ops)

    def gated_act(self, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        return pointwise.gated_act(gate, up, act, self.ops)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return pointwise.rope(x, cos, sin, self.ops)

    def project_qkv(self, c, w, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The first half of a layer (norm, q/k/v product, q/k norms, RoPE) as one kernel call
        (``kernels/layer.cpp``) when it is fused and ``h`` is float32 rows; else None (the runner
        composes it from the operations above)."""
        if not (self.fused and h.dtype == torch.float32 and h.dim() == 2) or _long(h):
            return None
        return self.ops.project_qkv(
            h,
            w.attn_norm,
            c.rms_norm_eps,
            w.wqkv.handle,
            w.bqkv,
            w.q_norm,
            w.k_norm,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            cos,
            sin,
        )

    def post_attention(self, c, w, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """The second half of a layer (output product, residual, MLP, residual) as one kernel call
        when it is fused and both inputs are float32 rows; else None."""
        f32 = torch.float32
        if not (self.fused and attn.dtype == f32 and h.dtype == f32 and h.dim() == 2) or _long(h):
            return None
        return self.ops.post_attention(
            attn,
            h,
            w.wo.handle,
            w.attn_out_norm,
            w.mlp_norm,
            w.w_gate.handle,
            w.w_up.handle,
            w.w_down.handle,
            w.mlp_out_norm,
            pointwise.ACTS[c.hidden_act],
            c.rms_norm_eps,
        )

    def step_kernel(self, kv_dtypes) -> ModuleType | None:
        """The attention kernel for a batched step whose sequences hold KV in ``kv_dtypes``: one KV
        dtype per call, one it reads; None: every sequence takes SDPA."""
        if self.ops is None:
            return None
        dtypes = set(kv_dtypes)
        return self.ops if len(dtypes) <= 1 and dtypes <= set(_KV_DTYPES) else None

    def run_stack(self, step, h: torch.Tensor, tables) -> torch.Tensor | None:
        """Every layer of a batched ``step`` (``batch.BatchStep``) in one kernel call
        (``kernels/stack.cpp``) when every sequence takes the attention kernel; ``tables``: (cos,
        sin) per rope kind in the stack's order. None: the runner's layer loop runs the step."""
        if not (
            self.fused and self.stack is not None and step.stacked and h.dtype == torch.float32
        ):
            return None
        return step.run_stack(self.stack, h, tables)


def _long(h: torch.Tensor) -> bool:
    """A pass long enough for PyTorch's GEMM (``packed.GEMM_ROWS``): the layer's halves are then
    composed from the operations, whose products take that path."""
    return h.shape[0] >= packed.GEMM_ROWS


def _build_stack(ops: ModuleType, config, weights, kinds: list[str]):
    """The model's layers described once for ``run_stack``: weights, windows, rope kinds (the
    order of ``kinds``, in which the runner hands over the rotation tables)."""
    c = config
    stack = ops.Stack(
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        act=pointwise.ACTS[c.hidden_act],
        eps=c.rms_norm_eps,
        scale=c.scaling,
        softcap=c.attn_logit_softcap or 0.0,
    )
    for i, w in enumerate(weights.layers):
        stack.add_layer(
            w.attn_norm,
            w.wqkv.handle,
            w.bqkv,
            w.q_norm,
            w.k_norm,
            w.wo.handle,
            w.attn_out_norm,
            w.mlp_norm,
            w.w_gate.handle,
            w.w_up.handle,
            w.w_down.handle,
            w.mlp_out_norm,
            c.window(i) or 0,
            kinds.index(c.layer_types[i]),
        )
    return stack
