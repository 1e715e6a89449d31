"""The architecture description the model runner executes.

Every supported family (``llama``, ``qwen2``, ``qwen3``, ``gemma3``) is parsed from its Hugging Face
``config.json`` into this one frozen ``ModelConfig``. The fields are architectural *features*
(q/k/v bias, q/k norm, sandwich norms, sliding windows) rather than family names, so the runner in
``transformer.py`` has a single code path and a family file only says which features it uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type. ``kind`` is ``default``, ``linear`` or ``llama3``.

    Position-dependent schemes (dynamic NTK) are rejected at parse time: a key rotated under them
    depends on the sequence length, so a cached key could not be re-used at another length.
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer, described by features. All sizes are per model, not per shard."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # One entry per layer: FULL or SLIDING; SLIDING layers attend to keys with q_pos - k_pos < window.
    layer_types: tuple[str, ...]
    rope: dict[str, RopeConfig]  # by layer type
    sliding_window: int | None = None
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (qwen3, gemma3)
    sandwich_norm: bool = False  # gemma: extra norms after attention and after the MLP
    embed_scale: float | None = None  # gemma: embeddings multiplied by sqrt(hidden_size)
    attn_scale: float | None = None  # None -> head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for t in set(self.layer_types):
            if t not in (FULL, SLIDING):
                raise ValueError(f"unknown layer type {t!r}")
            if t not in self.rope:
                raise ValueError(f"no RoPE configuration for layer type {t!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"unsupported activation {self.hidden_act!r} (supported: silu, gelu_tanh)"
            )

    @property
    def scaling(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for a global layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): part of the model fingerprint."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def parse_rope(d: dict, default_theta: float, max_pos: int) -> RopeConfig:
    """Parse a HF ``rope_scaling``/``rope_parameters`` entry (either generation of the format)."""
    d = dict(d or {})
    kind = d.get("rope_type", d.get("type", "default")) or "default"
    theta = float(d.get("rope_theta", default_theta))
    if kind == "default":
        return RopeConfig(
            theta=theta, partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0))
        )
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(d["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(d["factor"]),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position=int(d.get("original_max_position_embeddings", max_pos)),
        )
    raise ValueError(
        f"RoPE type {kind!r} is not supported (supported: default, linear, llama3); "
        "length-dependent schemes such as dynamic NTK make cached keys unusable at other lengths"
    )
