"""Llama family: Llama 2/3, SmolLM2, Mistral (pre-norm, SwiGLU, RoPE, grouped-query attention)."""

from __future__ import annotations

from .config import FULL, SLIDING, ModelConfig, parse_rope
from .family import Family, eos_ids, require

LLAMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def base_fields(d: dict, family: str) -> dict:
    """Fields shared by llama-like configs (also used by the Qwen parsers)."""
    hidden = int(require(d, "hidden_size", family))
    heads = int(require(d, "num_attention_heads", family))
    max_pos = int(d.get("max_position_embeddings") or 4096)
    if d.get("mlp_bias"):
        raise ValueError(f"{family}: mlp_bias=true is not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family}: hidden_act {act!r} is not supported (expected silu)")
    return dict(
        family=family,
        vocab_size=int(require(d, "vocab_size", family)),
        hidden_size=hidden,
        intermediate_size=int(require(d, "intermediate_size", family)),
        num_layers=int(require(d, "num_hidden_layers", family)),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope={
            FULL: parse_rope(
                d.get("rope_parameters") or d.get("rope_scaling"),
                float(d.get("rope_theta", 10000.0)),
                max_pos,
            )
        },
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids(d.get("eos_token_id")),
    )


def parse_config(d: dict) -> ModelConfig:
    fields = base_fields(d, "llama")
    window = d.get("sliding_window") if d.get("model_type") == "mistral" else None
    n = fields["num_layers"]
    if window:
        fields["rope"] = {SLIDING: fields["rope"][FULL]}
    return ModelConfig(
        **fields,
        layer_types=(SLIDING if window else FULL,) * n,
        sliding_window=int(window) if window else None,
        qkv_bias=bool(d.get("attention_bias", False)),
    )


FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral"),
    parse_config=parse_config,
    layer_norms=LLAMA_NORMS,
)
