"""GGUF file -> a Hugging Face style folder (config.json, model.safetensors, tokenizer files), and
the GGUF's own tensors for the runner.

Conversion dequantizes the weights once (``gguf.quants.dequantize``) to float32 in HF naming and
layout, so that the transformers reference and ``weights: fp32`` / ``int8`` load the result; the
folder keeps the GGUF file itself too (``model.gguf``), which ``weights: auto`` runs as shipped
(``read_raw_tensors``: the projections and the embedding in their own blocks, ``models.ggml``).
Two GGUF conventions are undone on both ways: llama.cpp permutes the rows of Llama's q/k
projections for its interleaved RoPE (a permutation of whole rows, so of whole rows of blocks),
and stores Gemma's RMSNorm weights as ``1 + w``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..progress import ProgressCallback, Step

# GGUF architecture -> (HF model_type, HF architecture class)
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF model kvfuse can convert."""


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            continue  # vocabularies are large and handled by the tokenizer conversion
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - an exotic field we do not need
            continue
    return out


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """The HF ``config.json`` equivalent of a GGUF header."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})"
        )
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            "GGUF files with a rope_freqs tensor (Llama 3.1 scaling) are not supported yet; use the HF folder"
        )
    model_type, cls = ARCHS[arch]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    cfg = {
        "model_type": model_type,
        "architectures": [cls],
        "vocab_size": int(get("vocab_size", 0)) or None,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        if scaling != "linear":
            raise GGUFError(f"GGUF RoPE scaling {scaling!r} is not supported (supported: linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    if arch == "gemma3":
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(get("attention.sliding_window", 4096)),
            rope_local_base_freq=10000.0,
            # llama.cpp: the 27B model scales by hidden/heads, the others by head_dim
            query_pre_attn_scalar=hidden // heads if int(get("block_count")) == 62 else head_dim,
        )
    return {k: v for k, v in cfg.items() if v is not None}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (per head: pairs -> halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def convert_tensors(
    reader, config: dict, progress: bool | None = None, on_progress: ProgressCallback | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name; ``progress`` / ``on_progress`` as in
    ``kvfuse.progress`` (one update per tensor)."""
    from gguf.quants import dequantize

    arch_is = config["model_type"]
    layer_names = _GEMMA_LAYER_NAMES if arch_is == "gemma3_text" else _LAYER_NAMES
    out: dict[str, torch.Tensor] = {}
    # Dequantizing takes minutes for the larger models: a bar on a terminal, lines in logs.
    with Step(
        "converting weights",
        len(reader.tensors),
        "tensors",
        progress=progress,
        on_progress=on_progress,
    ) as step:
        for t in reader.tensors:
            name = _hf_name(t, layer_names, arch_is)
            out[name] = _dequantized(t, name, config, arch_is, dequantize)
            step.update()
    if "vocab_size" not in config:
        config["vocab_size"] = out["model.embed_tokens.weight"].shape[0]
    return out


def _hf_name(t, layer_names: dict, arch_is: str) -> str:
    if t.name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[t.name]
    if m := _BLOCK.match(t.name):
        layer, kind, suffix = m.groups()
        if kind not in layer_names:
            raise GGUFError(f"unexpected GGUF tensor {t.name!r} for a {arch_is} model")
        return f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
    raise GGUFError(f"unexpected GGUF tensor {t.name!r}")


def _dequantized(t, name: str, config: dict, arch_is: str, dequantize) -> torch.Tensor:
    """One GGUF tensor as float32 in HF layout (llama q/k rows un-permuted, Gemma norms as ``w``)."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dims fastest-first
    w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if arch_is == "llama" and kind_of(t.name) in ("attn_q", "attn_k"):
        heads = (
            config["num_attention_heads"]
            if kind_of(t.name) == "attn_q"
            else config["num_key_value_heads"]
        )
        w = _unpermute(w, heads)
    if arch_is == "gemma3_text" and name.endswith("norm.weight"):
        w = w - 1.0
    return torch.from_numpy(w if w.flags.writeable else w.copy())


#: The tensors ``read_raw_tensors`` keeps in their own blocks: the projections and the embedding.
_RAW_KINDS = frozenset(
    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)
_RAW_GLOBAL = frozenset(("token_embd.weight", "output.weight"))


def read_raw_tensors(path: Path, config: dict) -> dict:
    """The GGUF file's tensors under their HF names (``config``: the folder's ``config.json``):
    the projections and the embedding as ``ggml.RawTensor`` (the file's bytes, read once into
    memory; Llama's q/k rows un-permuted), every other tensor (norms, biases) as float32, as
    conversion writes them. The file is memory-mapped while it is read, then let go."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF file"
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    arch_is = config["model_type"]
    layer_names = _GEMMA_LAYER_NAMES if arch_is == "gemma3_text" else _LAYER_NAMES
    out: dict = {}
    for t in reader.tensors:
        name = _hf_name(t, layer_names, arch_is)
        raw = t.name in _RAW_GLOBAL or (kind_of(t.name) in _RAW_KINDS and name.endswith(".weight"))
        if raw and t.tensor_type.value != 0:  # F32 projections stay float32 (blocked)
            out[name] = _raw(t, config, arch_is)
        else:
            out[name] = _dequantized(t, name, config, arch_is, dequantize)
    del reader
    return out


def _raw(t, config: dict, arch_is: str):
    """One GGUF tensor as a ``ggml.RawTensor`` in HF row order (a copy of the file's bytes)."""
    from .ggml import RawTensor

    cols, rows = (int(d) for d in t.shape[:2])  # GGML lists dims fastest-first
    data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    if arch_is == "llama" and kind_of(t.name) in ("attn_q", "attn_k"):
        heads = config[
            "num_attention_heads" if kind_of(t.name) == "attn_q" else "num_key_value_heads"
        ]
        data = _unpermute(data, heads)
    return RawTensor(
        torch.from_numpy(np.array(data, order="C")), int(t.tensor_type.value), (rows, cols)
    )


def kind_of(tensor_name: str) -> str | None:
    m = _BLOCK.match(tensor_name)
    return m.group(2) if m else None


def convert_gguf(
    path: Path,
    out_dir: Path,
    chat_template: str | None = None,
    extra_eos: tuple[int, ...] = (),
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> None:
    """Write ``out_dir`` (which must exist and be empty) from the GGUF file at ``path``; each step
    (weights, the safetensors file, the tokenizer) shows its progress (``kvfuse.progress``)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF file"
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    meta = _fields(reader)
    config = hf_config(meta, {t.name for t in reader.tensors})
    tensors = convert_tensors(reader, config, progress, on_progress)
    with Step("writing model.safetensors", progress=progress):
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    eos = [config["eos_token_id"], *extra_eos] if "eos_token_id" in config else list(extra_eos)
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": list(dict.fromkeys(eos))}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    with Step("converting the tokenizer (transformers)", progress=progress):
        _convert_tokenizer(path, out_dir, chat_template)


def _convert_tokenizer(path: Path, out_dir: Path, chat_template: str | None) -> None:
    # transformers owns the GGUF vocabulary -> tokenizer.json conversion (BPE and SentencePiece
    # flavours, pre-tokenizers per model); it runs once, at conversion time.
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
