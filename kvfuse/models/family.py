"""What distinguishes one model family from another: config parsing and weight naming.

The runner has one code path; a ``Family`` maps a Hugging Face ``config.json`` onto
``ModelConfig`` features and says how its checkpoint names the per-layer norms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # HF ``model_type`` values this family reads
    parse_config: Callable[[dict], ModelConfig]
    # HF norm name (under ``model.layers.N.``) -> field of ``LayerWeights``.
    layer_norms: dict[str, str]
    # Gemma stores RMSNorm weights as w and multiplies by (1 + w): added once at load time.
    norm_offset: float = 0.0


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def require(d: dict, key: str, family: str):
    if d.get(key) is None:
        raise ValueError(
            f"{family} config.json lacks {key!r}; is this a complete Hugging Face config?"
        )
    return d[key]
