"""Qwen2 (q/k/v projections with bias) and Qwen3 (RMSNorm on q and k per head, no bias)."""

from __future__ import annotations

from .config import FULL, ModelConfig
from .family import Family
from .llama import LLAMA_NORMS, base_fields


def _no_sliding(d: dict, family: str) -> None:
    if d.get("use_sliding_window"):
        raise ValueError(
            f"{family}: use_sliding_window=true is not supported (no released checkpoint uses it)"
        )


def parse_qwen2(d: dict) -> ModelConfig:
    _no_sliding(d, "qwen2")
    fields = base_fields(d, "qwen2")
    return ModelConfig(**fields, layer_types=(FULL,) * fields["num_layers"], qkv_bias=True)


def parse_qwen3(d: dict) -> ModelConfig:
    _no_sliding(d, "qwen3")
    fields = base_fields(d, "qwen3")
    return ModelConfig(
        **fields,
        layer_types=(FULL,) * fields["num_layers"],
        qkv_bias=bool(d.get("attention_bias", False)),
        qk_norm=True,
    )


QWEN2 = Family(
    name="qwen2", model_types=("qwen2",), parse_config=parse_qwen2, layer_norms=LLAMA_NORMS
)
QWEN3 = Family(
    name="qwen3", model_types=("qwen3",), parse_config=parse_qwen3, layer_norms=LLAMA_NORMS
)
