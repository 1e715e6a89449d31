"""Tiny random-weight models of every family, built locally with transformers (no downloads).

Each is saved as a Hugging Face folder so that the kvfuse loader and the transformers reference
read the very same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        num_hidden_layers=3,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **BASE,
    ),
    "llama3-rope": dict(
        model_type="llama",
        num_hidden_layers=2,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        rope_theta=500000.0,
        **BASE,
    ),
    "mistral": dict(
        model_type="mistral",
        num_hidden_layers=2,
        sliding_window=48,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **BASE,
    ),
    "qwen2": dict(
        model_type="qwen2",
        num_hidden_layers=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        **BASE,
    ),
    "qwen3": dict(
        model_type="qwen3",
        num_hidden_layers=2,
        head_dim=32,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        **BASE,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        num_hidden_layers=6,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=48,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        **{**BASE, "num_key_value_heads": 1},
    ),
}


def build_tiny(name: str, folder: Path, seed: int = 0) -> Path:
    """Create a random model of family ``name`` and save it to ``folder`` (returns it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[name])
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                # gemma norms are (1 + w) with w around 0; llama norms are w around 1
                p.copy_(
                    torch.randn_like(p) * 0.1
                    + (0.0 if cfg["model_type"].startswith("gemma") else 1.0)
                )
            else:
                p.copy_(torch.randn_like(p) * 0.12)
    model.save_pretrained(folder)
    return folder
