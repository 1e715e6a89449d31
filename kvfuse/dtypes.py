"""The one table of floating-point types: their names in the configuration, their torch dtypes,
their codes in entry headers and their sizes.

Every module that names, stores or converts a dtype reads it here, so a type is added (or a code
assigned) in one place. torch is imported on first use: the configuration, which only needs the
names, stays importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> (entry header code, bytes per element). Codes are part of the entry format: never reuse one.
_TABLE = {"float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4)}
ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
}

KV_DTYPES: tuple[str, ...] = tuple(_TABLE)  # what KV may be stored as (cache.kv_dtype)
COMPUTE_DTYPES: tuple[str, ...] = (
    "float32",
    "bfloat16",
    "float16",
)  # what a model may compute in (dtype)


def canonical(name: str) -> str:
    """The table's name for ``name`` or one of its aliases; ValueError for an unknown type."""
    name = ALIASES.get(name, name)
    if name not in _TABLE:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_TABLE)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``name`` (or an alias)."""
    import torch

    return getattr(torch, canonical(name))


def name_of(dtype: torch.dtype) -> str:
    """The table's name of a torch dtype; ValueError for one the table does not hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in _TABLE:
        raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(_TABLE)}")
    return name


def code_of(dtype: torch.dtype) -> int:
    """The entry header code of ``dtype``."""
    return _TABLE[name_of(dtype)][0]


def from_code(code: int) -> torch.dtype | None:
    """The dtype an entry header code stands for (None: no such code)."""
    name = next((n for n, (c, _) in _TABLE.items() if c == code), None)
    return None if name is None else torch_dtype(name)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return _TABLE[name_of(dtype)][1]
