"""What the process holds in memory: its resident size, the model's weights as loaded, the live
KV, for the line ``kvfuse serve`` prints at start-up and for ``/metrics``.

The resident size is the kernel's figure (``VmRSS`` of ``/proc/self/status``; None where there is
none). The weights are counted as the runner holds them: a GGUF's blocks in the file's own
quantization (``weights: auto``), or the float32 / int8 copy, the embedding included and a tied
output matrix once. What is left of the resident size is the runtime: Python, PyTorch and its
libraries, the server, the allocator's cached pages.
"""

from __future__ import annotations

import dataclasses

from .models.quant import held_bytes

MB = 1 << 20


def resident_bytes(status_path: str = "/proc/self/status") -> int | None:
    """This process's resident size in bytes (``VmRSS``), or None where the system has none."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weights_bytes(weights) -> int:
    """Bytes of a runner's ``Weights`` as held: every distinct tensor or block store once (a tied
    output matrix is the embedding)."""
    seen: dict[int, int] = {}
    parts = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        parts += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    for w in parts:
        if w is not None:
            seen.setdefault(id(w), held_bytes(w))
    return sum(seen.values())


def memory_line(resident: int | None, weights: int, kv_used: int, kv_limit: int) -> str:
    """The start-up line: ``memory: resident 905 MB (weights 98 MB, live KV 0 MB of 2048 MB,
    runtime 807 MB)``; ``kv_limit`` 0: no budget."""
    budget = f" of {kv_limit / MB:.0f} MB" if kv_limit else " (no budget)"
    kv = f"live KV {kv_used / MB:.0f} MB{budget}"
    if resident is None:
        return f"memory: weights {weights / MB:.0f} MB, {kv} (resident size unknown here)"
    rest = max(0, resident - weights - kv_used)
    return (
        f"memory: resident {resident / MB:.0f} MB (weights {weights / MB:.0f} MB, {kv}, "
        f"runtime {rest / MB:.0f} MB)"
    )
