"""The KV chunk: the KV cache of a run of tokens, for every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVChunk:
    """Keys and values of ``tokens`` consecutive cache slots, for all layers.

    ``kv`` has shape ``(layers, 2, tokens, kv_heads, head_dim)`` (index 0 = K, 1 = V), the layout
    LMCache uses too. Keys are stored *after* RoPE, rotated at ``positions`` (int64, one per token):
    re-using a chunk at other positions needs a delta rotation (``kvfuse.models.rope``).
    ``token_ids``, when known, are the tokens whose KV it is (recorded in the entry, checked on load).
    """

    kv: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor | None = None  # int64, the token id of each slot (None: not known)

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2:
            raise ValueError(
                f"KVChunk.kv must be (layers, 2, tokens, kv_heads, head_dim), got {tuple(self.kv.shape)}"
            )
        if self.positions.dim() != 1 or self.positions.shape[0] != self.kv.shape[2]:
            raise ValueError(
                f"KVChunk.positions must have one entry per token ({self.kv.shape[2]}), got {tuple(self.positions.shape)}"
            )
        if self.positions.dtype != torch.int64:
            raise ValueError(f"KVChunk.positions must be int64, got {self.positions.dtype}")
        t = self.token_ids
        if t is not None and (
            t.dim() != 1 or t.shape[0] != self.kv.shape[2] or t.dtype != torch.int64
        ):
            raise ValueError(
                f"KVChunk.token_ids must be int64, one per token ({self.kv.shape[2]}), got "
                f"{t.dtype} {tuple(t.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
