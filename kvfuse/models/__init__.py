"""Weights -> a runnable model: built-in names, HF/GGUF loading, the PyTorch runner, the tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import dtypes
from .cache import KVCache
from .config import ModelConfig
from .cpu.backend import CpuBackend, KernelsUnavailable
from .loader import fingerprint, load_folder, sha256_file, weight_files
from .quant import WEIGHT_FORMATS, QuantizationUnavailable, identity_of
from .registry import (
    BUILTIN,
    MANIFEST,
    CorruptModel,
    ModelNotFound,
    ModelPackageMissing,
    default_home,
    pull,
    pull_gguf,
    read_manifest,
    verify_folder,
)
from .tokenizer import Tokenizer
from .transformer import Transformer

__all__ = [
    "BUILTIN",
    "CorruptModel",
    "CpuBackend",
    "KVCache",
    "KernelsUnavailable",
    "LoadedModel",
    "ModelConfig",
    "ModelNotFound",
    "ModelPackageMissing",
    "QuantizationUnavailable",
    "Tokenizer",
    "Transformer",
    "WEIGHT_FORMATS",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A runner, its tokenizer, and the identity that namespaces its cache entries."""

    name: str
    folder: Path
    runner: Transformer
    tokenizer: Tokenizer
    fingerprint: str
    weights: str = "auto"  # the weight format: auto (the compute dtype) or int8 (see quant)

    @property
    def config(self) -> ModelConfig:
        return self.runner.config

    @property
    def backend(self) -> CpuBackend:
        """The CPU path chosen for this model (``cpu.backend``): kernels or PyTorch, weights' form."""
        return self.runner.backend

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but no CUDA GPU is available; use --device cpu"
        )
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Compute dtype: fp32 on CPU (bf16 matmuls are several times slower there), bf16 on CUDA."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    return dtypes.torch_dtype(dtype)


def load_model(
    name_or_path: str | Path,
    home: Path | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    weights: str = "auto",
    kernels: str | None = None,
) -> LoadedModel:
    """Load a built-in model name, an HF style folder, or a ``.gguf`` file.

    Built-in names and GGUF files are converted once into ``home`` (see ``registry``) and their
    checksums verified at every load; an HF folder is used in place. ``weights`` is ``auto`` (the
    compute dtype) or ``int8`` (the projections packed as int8, see ``quant``; CPU only, so device
    ``auto`` means the CPU). The format is part of the fingerprint: int8 and full-precision KV
    never share cache entries. ``kernels``: the ``kernels`` setting (``auto``, ``on``, ``off``)
    the CPU backend is chosen by (``cpu.backend``; None: ``$KVFUSE_KERNELS``, else ``auto``).
    """
    home = Path(home) if home else default_home()
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weights format {weights!r}; use one of: {', '.join(WEIGHT_FORMATS)}"
        )
    if weights == "int8" and str(device) == "auto":
        device = "cpu"  # int8 weights run on the CPU only
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    text = str(name_or_path)
    path = Path(text).expanduser()
    if text in BUILTIN:
        folder, name, verified = pull(text, home), text, True
    elif path.is_file() and path.suffix == ".gguf":
        folder, name, verified = pull_gguf(path, home), path.stem, True
    elif path.is_dir():
        folder, name, verified = path, path.name, False
    else:
        raise ModelNotFound(
            f"unknown model {text!r}: not a built-in name ({', '.join(BUILTIN)}), a model folder, or a .gguf file"
        )
    runner = load_folder(folder, device, dtype, weights, kernels)
    digests = _weight_digests(folder, verified)
    return LoadedModel(
        name,
        folder,
        runner,
        Tokenizer(folder),
        fingerprint(runner.config, digests, weights, identity_of(runner.weights)),
        weights,
    )


def _weight_digests(folder: Path, verified: bool) -> list[str]:
    """sha256 of each weight file: from a converted folder's manifest (checked, unless ``pull``
    just did), or computed for a plain HF folder."""
    if (folder / MANIFEST).is_file():
        manifest = read_manifest(folder) if verified else verify_folder(folder)
        return [manifest["files"][f.name] for f in weight_files(folder)]
    return [sha256_file(f) for f in weight_files(folder)]
