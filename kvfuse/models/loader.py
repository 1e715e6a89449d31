"""Hugging Face style folder (config.json + *.safetensors) -> a runnable ``Transformer``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from . import gemma3, ggml, llama, qwen
from .config import ModelConfig
from .cpu.backend import select
from .family import Family
from .gguf import read_raw_tensors
from .quant import INT8_IDENTITY, WEIGHT_FORMATS, check_int8_supported
from .transformer import LayerWeights, Transformer, Weights

FAMILIES: dict[str, Family] = {
    t: fam for fam in (llama.FAMILY, qwen.QWEN2, qwen.QWEN3, gemma3.FAMILY) for t in fam.model_types
}

# Prefixes under which multimodal checkpoints keep their language model.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def family_of(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {known}"
        )
    return FAMILIES[model_type]


def read_config(folder: Path) -> tuple[dict, ModelConfig]:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf = json.loads(path.read_text())
    config = family_of(hf).parse_config(hf)
    gen = folder / "generation_config.json"
    if gen.is_file():  # chat models often list their end-of-turn token here only
        extra = json.loads(gen.read_text()).get("eos_token_id")
        if extra is not None:
            ids = extra if isinstance(extra, list) else [extra]
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, ids)]))
            config = replace(config, eos_token_ids=merged)
    return hf, config


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                key = name
                for prefix in _TEXT_PREFIXES:
                    if name.startswith(prefix):
                        key = "model." + name[len(prefix) :]
                tensors[key] = st.get_tensor(name)
    return tensors


def build_weights(
    config: ModelConfig,
    family: Family,
    tensors: Mapping[str, object],
    device,
    dtype,
    projection: Callable[[list], object] | None = None,
) -> Weights:
    """Assemble (and fuse) the runner's weights from HF-named tensors. ``projection(parts)``
    makes one projection (or the embedding) from its tensors, stacked along the output channels
    (default: float32 tensors concatenated); the GGUF path passes ``ggml.projection``, whose
    parts may be a file's own blocks."""

    def get(name: str):
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r} expected by a {family.name} model")
        t = tensors[name]
        return _aligned(t.to(device=device, dtype=dtype)) if isinstance(t, torch.Tensor) else t

    def proj(*names: str):
        parts = [get(n) for n in names]
        if projection is not None:
            return projection(parts)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def norm(name: str) -> torch.Tensor:
        w = tensors[name].to(device=device, dtype=torch.float32)
        return (w + family.norm_offset) if family.norm_offset else w

    layers = [_layer(config, family, i, get, proj, norm) for i in range(config.num_layers)]
    embed = proj("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        lm_head = embed
    else:
        lm_head = proj("lm_head.weight")
    if embed.shape[0] != config.vocab_size:
        raise ValueError(
            f"embedding has {embed.shape[0]} rows but config.json says vocab_size={config.vocab_size}"
        )
    return Weights(
        embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=lm_head
    )


def _layer(config: ModelConfig, family: Family, i: int, get, proj, norm) -> LayerWeights:
    """Layer ``i``'s weights (``get`` a tensor, ``proj`` a projection, ``norm`` a norm by name)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    bias = None
    if config.qkv_bias:
        bias = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
    norms = {field: norm(p + hf + ".weight") for hf, field in family.layer_norms.items()}
    return LayerWeights(
        wqkv=proj(*(a + f"{x}_proj.weight" for x in "qkv")),
        bqkv=bias,
        wo=proj(a + "o_proj.weight"),
        w_gate=proj(p + "mlp.gate_proj.weight"),
        w_up=proj(p + "mlp.up_proj.weight"),
        w_down=proj(p + "mlp.down_proj.weight"),
        q_norm=norm(a + "q_norm.weight") if config.qk_norm else None,
        k_norm=norm(a + "k_norm.weight") if config.qk_norm else None,
        **norms,
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its own 64-byte aligned memory. Tensors read from safetensors files sit at the
    file's offsets; on this CPU a matmul with such a misaligned weight ran ~5% slower."""
    return (
        t.contiguous() if t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)
    )


def load_folder(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: str = "auto",
    kernels: str | None = None,
) -> Transformer:
    """Load a Hugging Face style model folder onto ``device`` in compute ``dtype``; ``weights``
    ``int8`` packs the projections as int8 (``quant.quantize_weights``, CPU only). ``kernels``:
    the ``kernels`` setting the CPU backend is chosen by (``cpu.backend.select``; None: from the
    environment, else ``auto``)."""
    folder = Path(folder)
    hf, config = read_config(folder)
    device = torch.device(device)
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weights format {weights!r}; use one of: {', '.join(WEIGHT_FORMATS)}"
        )
    backend = select(kernels, device, dtype, weights)
    if weights == "int8":  # before reading the weights
        check_int8_supported(device, fbgemm=backend.weights == "fbgemm-int8")
    source = ggml.gguf_file(folder)
    if weights == "auto" and backend.ggml and source is not None:
        tensors = read_raw_tensors(source, hf)
        built = build_weights(
            config,
            family_of(hf),
            tensors,
            device,
            dtype,
            lambda parts: ggml.projection(parts, backend.kernel),
        )
    else:
        built = build_weights(config, family_of(hf), read_tensors(folder), device, dtype)
    return Transformer(config, backend.pack(built), device, dtype, backend)


def sha256_file(
    path: Path, block: int = 8 << 20, on_block: Callable[[int], None] | None = None
) -> str:
    """The file's sha256; ``on_block(n)`` after every ``n`` bytes hashed (progress)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
            if on_block is not None:
                on_block(len(chunk))
    return h.hexdigest()


def fingerprint(
    config: ModelConfig,
    weight_digests: list[str],
    weights: str = "auto",
    implementation: str | None = None,
) -> str:
    """The model's identity in cache keys: a hash of its architecture, of its weight files and of
    the format its weights run in. int8 weights compute other KV than the files' own precision,
    so their entries live in a namespace of their own, one per int8 implementation
    (``implementation``: a ``quant.INT8_IDENTITY`` value, default what the CPU backend picks on
    this machine with the environment's ``kernels`` setting; ``auto`` adds nothing: the identity
    of models loaded as before is unchanged)."""
    h = hashlib.sha256(b"kvfuse-model-v1\0")
    h.update(config.to_json().encode())
    for d in weight_digests:
        h.update(b"\0" + d.encode())
    if weights == "int8":
        if implementation is None:
            implementation = INT8_IDENTITY[
                select(None, "cpu", torch.float32, "int8").int8_implementation
            ]
        h.update(b"\0weights=" + implementation.encode())
    return h.hexdigest()[:32]
