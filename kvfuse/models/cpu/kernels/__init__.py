"""CPU kernels the runner uses when it can build them, compiled into one module:

- ``batch_attention.cpp``: attention of every decoding sequence of a batched step, and the write
  of their fresh K/V (below);
- ``linear.cpp``: the projections, for float32 and int8 weights in blocks of 16 output channels
  (``models.packed.BlockedWeight`` says why);
- ``pointwise.cpp``: RMSNorm (with the residual add before it), the gated activation and RoPE,
  one call each instead of several PyTorch operators (``models.pointwise``);
- ``layer.cpp``: the two halves of a layer around attention (``Transformer.project`` and
  ``post_attention``) as one call each, from those pieces, when every projection is blocked;
- ``stack.cpp``: every layer of a decode step in one call (``batch.BatchStep.run_stack``), when
  every sequence of the step takes the attention kernel.

Why an attention kernel: a batched decode step attends one query per running sequence over that
sequence's own KV buffer. In PyTorch that is one SDPA call per sequence and layer (480 calls for
16 sequences of SmolLM2), each paying a fixed dispatch and threading cost plus a conversion of
fp16 K/V to fp32, and padding every sequence into one tensor copies all the KV at every layer
(``bench/kv_layout.py``). The kernel reads each sequence's buffer in place, in its stored dtype,
with the same position mask as ``attention.position_mask`` (sliding windows and soft-capping
included), in one call per layer; ``write_kv`` likewise writes a step's fresh K/V rows into every
sequence's buffer in one call.

The module is compiled once per machine and checkout with ``torch.utils.cpp_extension`` (g++ and
ninja; about two minutes on 2 cores) into PyTorch's extension folder (``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), under a name that includes a digest of this folder's path:
the build records its sources' paths, so two checkouts on one machine (git worktrees) sharing one
name would rebuild it for each other at every switch. ``get()`` returns the built module, or None
when it cannot be built (no compiler, not x86): whether the runner uses it is the backend's
choice (``models.cpu.backend``, from the ``kernels`` setting), not this module's; without it the
runner keeps its PyTorch path, which computes the same numbers up to float rounding.
``python -m kvfuse.models.cpu.kernels`` builds it ahead of time (``scripts/install.sh`` does). It is built with OpenMP: ``at::parallel_for``
in a header compiled without it runs on one thread, which is how the attention kernel ran
until the module was rebuilt with ``-fopenmp`` (the symbols resolve to PyTorch's own OpenMP
runtime, so ``torch.set_num_threads`` governs the kernels too).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_DIR = Path(__file__).resolve().parent
_SOURCES = [
    _DIR / f
    for f in (
        "module.cpp",
        "batch_attention.cpp",
        "linear.cpp",
        "pointwise.cpp",
        "layer.cpp",
        "stack.cpp",
        "ggml.cpp",
        "ggml_avx2.cpp",
        "ggml_avx512.cpp",
        "isa.cpp",
    )
]
# v10: bump when the sources change in a way the build cache must not reuse; the digest: one build
# per checkout (see the module docstring).
_NAME = "kvfuse_cpu_kernels_v10_" + hashlib.sha256(str(_DIR).encode()).hexdigest()[:8]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def get() -> ModuleType | None:
    """The compiled kernel module, building it on first use; None if it cannot be built (logged
    once, with the reason)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def built() -> bool:
    """Whether the module is loaded or compiled already, so that ``get`` would not build it now
    (``kvfuse models list`` asks, and builds nothing)."""
    if _state.get("module") is not None:
        return True
    try:
        from torch.utils import cpp_extension

        folder = Path(cpp_extension._get_build_directory(_NAME, verbose=False))
    except Exception:  # another PyTorch's internals: say not built, never fail a listing
        return False
    return (folder / f"{_NAME}.so").is_file()


#: The instruction sets every kernel of the module needs (x86-64 with AVX2, FMA and F16C: every
#: x86 server CPU since 2013). The module is compiled for exactly these, whatever CPU builds it,
#: so one build runs on every CPU that has them; the GGUF kernels' AVX-512 versions are compiled
#: beside them and chosen at run time where the CPU has AVX-512 (``ggml_ops.h``, ``isa.cpp``).
FLOOR = ("avx2", "fma", "f16c")


def _flags() -> list[str]:
    """-O3 and OpenMP, and the floor's instruction sets (F16C widens fp16 K/V eight at a time;
    AVX2 + FMA run the register tiles)."""
    return ["-O3", "-fopenmp", "-mavx", *(f"-m{f}" for f in FLOOR)]


def cpu_flags() -> set[str]:
    """The instruction-set flags this CPU reports (``/proc/cpuinfo``; empty where there is none)."""
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in cpu.splitlines() if line.startswith("flags")), "").split())


# What the kernels ask of the CPU: AVX-512 (F, BW, VL, DQ) for their wide tables (isa.cpp's
# choice, made again from cpuid at run time), and the flags that a listing names beside it.
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
LISTED = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def isa_for(flags: set[str]) -> str:
    """The instruction set the GGUF kernels pick on a CPU with ``flags``: ``avx512``, ``avx2``
    (the floor), or ``none`` below the floor (the kernels do not build)."""
    if floor_missing(flags):
        return "none"
    return "avx512" if all(f in flags for f in AVX512) else "avx2"


def listed_features(flags: set[str] | None = None) -> list[str]:
    """The ``LISTED`` instruction sets of a CPU with ``flags`` (default: this one's), in order."""
    have = cpu_flags() if flags is None else flags
    return [f for f in LISTED if f in have]


def cpu_line(flags: set[str] | None = None) -> str:
    """The CPU's instruction sets in one line, and which the kernels run (listings, start-up)."""
    have = cpu_flags() if flags is None else flags
    named = listed_features(have)
    missing = [f for f in ("avx512_bf16", "amx_bf16") if f not in have]
    return (
        f"{' '.join(named) or 'no listed instruction sets'}"
        + (f" (no {', '.join(missing)})" if missing else "")
        + f"; GGUF kernels: {isa_for(have)}"
    )


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("model name")), None)
    return line.split(":", 1)[1].strip() if line else None


def floor_missing(flags: set[str] | None = None) -> list[str]:
    """The floor's instruction sets this CPU lacks (``flags``: its flags, default read now); on a
    machine that is not x86-64, all of them."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return list(FLOOR)
    have = cpu_flags() if flags is None else flags
    return [f for f in FLOOR if f not in have]


def _build() -> ModuleType | None:
    missing = floor_missing()
    if missing:
        log.warning(
            "CPU kernels unavailable: this CPU lacks %s; using PyTorch's attention and projections",
            ", ".join(missing),
        )
        return None
    try:
        from torch.utils import cpp_extension

        log.info(
            "loading kvfuse's CPU kernels (compiled once per machine, about two minutes on 2 cores)"
        )
        return cpp_extension.load(
            name=_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=_flags(), verbose=False
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: the PyTorch path still works
        log.warning(
            "CPU kernels unavailable (%s: %s); using PyTorch's attention and projections "
            "(kernels: off, or KVFUSE_KERNELS=off, skips the attempt)",
            type(exc).__name__,
            str(exc).splitlines()[0][:200],
        )
        return None
