"""Gemma 3 (text): interleaved sliding-window and global layers with their own RoPE bases, q/k
RMSNorm, sandwich norms around attention and MLP, embeddings scaled by sqrt(hidden), (1 + w) norms."""

from __future__ import annotations

from .config import FULL, SLIDING, ModelConfig, parse_rope
from .family import Family, eos_ids, require

GEMMA3_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


def _layer_types(d: dict, n: int) -> tuple[str, ...]:
    names = {"sliding_attention": SLIDING, "full_attention": FULL}
    if d.get("layer_types"):
        try:
            return tuple(names[t] for t in d["layer_types"])
        except KeyError as e:
            raise ValueError(f"gemma3: unknown layer type {e.args[0]!r}") from None
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))


def parse_config(d: dict) -> ModelConfig:
    if "text_config" in d:  # the multimodal wrapper: run its language model
        d = {
            **d["text_config"],
            "eos_token_id": d["text_config"].get("eos_token_id", d.get("eos_token_id")),
        }
    if d.get("use_bidirectional_attention"):
        raise ValueError("gemma3: bidirectional attention (embedding models) is not supported")
    hidden = int(require(d, "hidden_size", "gemma3"))
    heads = int(require(d, "num_attention_heads", "gemma3"))
    n = int(require(d, "num_hidden_layers", "gemma3"))
    max_pos = int(d.get("max_position_embeddings") or 131072)
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"gemma3: activation {act!r} is not supported (expected gelu_pytorch_tanh)"
        )
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention")
    else:
        full, local = d.get("rope_scaling"), None
    return ModelConfig(
        family="gemma3",
        vocab_size=int(require(d, "vocab_size", "gemma3")),
        hidden_size=hidden,
        intermediate_size=int(require(d, "intermediate_size", "gemma3")),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or 256),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        layer_types=_layer_types(d, n),
        rope={
            FULL: parse_rope(full, float(d.get("rope_theta", 1_000_000.0)), max_pos),
            SLIDING: parse_rope(local, float(d.get("rope_local_base_freq", 10_000.0)), max_pos),
        },
        sliding_window=int(d.get("sliding_window") or 4096),
        hidden_act="gelu_tanh",
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=hidden**0.5,
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id", 2),
        eos_token_ids=eos_ids(d.get("eos_token_id", 1)),
    )


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    parse_config=parse_config,
    layer_norms=GEMMA3_NORMS,
    norm_offset=1.0,
)
