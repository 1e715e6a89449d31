"""Chunks vs vLLM's paged blocks: pure arithmetic, no vLLM and no torch.

kvfuse stores a prompt in chunks of ``chunk_size`` tokens (one entry per full chunk, keyed by the
prefix hash chain); vLLM keeps a request's KV in blocks of ``block_size`` tokens, listed in the
request's block table (``block_ids``: block ``i`` holds tokens ``[i * block_size, (i + 1) *
block_size)``). The connector only moves whole chunks, so a chunk must be a whole number of blocks:
``chunk_size % block_size == 0`` (``check_alignment``). vLLM's attention kernels may split a
(manager) block into smaller *kernel* blocks (the per-layer tensors are then indexed by kernel
block); ``kernel_block_ids`` maps one onto the other.

The rules the connector follows, here as functions:

- a load ends on a block boundary before the last token (vLLM must compute at least one token to
  produce logits, and counts computed tokens in whole blocks): ``load_limit``; a lookup asks for
  the full chunks that start before that limit (``lookup_chunks``), and the last of them may be
  loaded in part (a prompt of exactly 8 chunks loads 7 chunks and the first blocks of the 8th);
- chunks vLLM already holds (``num_computed_tokens``, block aligned, from its own prefix cache) are
  not asked for; a hit may start inside a chunk vLLM holds in part, and then only that chunk's
  missing blocks are written: ``matched_tokens``, ``load_spans``;
- a chunk is saved in the step that completes it, once, and only if it lies inside the prompt:
  ``completed_chunks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class AlignmentError(ValueError):
    """kvfuse's chunk size and vLLM's block size do not fit together."""


def check_alignment(chunk_size: int, block_size: int) -> int:
    """The number of vLLM blocks per kvfuse chunk; AlignmentError unless the chunk size is a
    positive multiple of the block size."""
    for name, v in (("chunk_size", chunk_size), ("block_size", block_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise AlignmentError(f"{name} must be a positive int, got {v!r}")
    if chunk_size % block_size:
        multiples = ", ".join(str(block_size * k) for k in (1, 2, 4) if block_size * k >= 16)
        raise AlignmentError(
            f"kvfuse's chunk_size ({chunk_size} tokens) must be a multiple of vLLM's block size ({block_size} "
            f"tokens): set chunk_size in kv_connector_extra_config to e.g. {multiples or block_size}, "
            f"or start vLLM with --block-size dividing {chunk_size}"
        )
    return chunk_size // block_size


def load_limit(num_tokens: int, block_size: int) -> int:
    """The most tokens of a request of ``num_tokens`` tokens a load may provide: the whole blocks
    before its last token."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return max(0, num_tokens - 1) // block_size * block_size


def lookup_chunks(num_tokens: int, chunk_size: int, block_size: int) -> int:
    """How many leading full chunks of a request of ``num_tokens`` tokens a lookup asks for: those
    starting before ``load_limit`` (only full chunks have keys)."""
    limit = load_limit(num_tokens, block_size)
    return min(-(-limit // chunk_size), num_tokens // chunk_size)


def first_needed_chunk(num_computed_tokens: int, chunk_size: int) -> int:
    """The chunk holding the first token vLLM has not computed (it may hold part of it)."""
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    return num_computed_tokens // chunk_size


def matched_tokens(
    num_computed_tokens: int, first_chunk: int, hits: int, chunk_size: int, limit: int
) -> int:
    """Tokens beyond ``num_computed_tokens`` that ``hits`` contiguous stored chunks starting at
    ``first_chunk`` provide, up to ``limit`` (``load_limit``); 0 when they end before what vLLM
    holds."""
    if hits < 0:
        raise ValueError(f"hits must be >= 0, got {hits}")
    return max(0, min((first_chunk + hits) * chunk_size, limit) - num_computed_tokens)


@dataclass(frozen=True)
class ChunkSpan:
    """Chunk ``index`` covers tokens ``[start, end)``; the load writes ``[write_start, write_end)``
    of it (``write_start > start`` when vLLM already holds the chunk's first blocks,
    ``write_end < end`` for the last chunk when its end is past the load's)."""

    index: int
    start: int
    end: int
    write_start: int
    write_end: int

    @property
    def written_tokens(self) -> int:
        return self.write_end - self.write_start


def load_spans(load_start: int, load_end: int, chunk_size: int, block_size: int) -> list[ChunkSpan]:
    """The chunks a load of tokens ``[load_start, load_end)`` reads (both block aligned:
    vLLM's count of computed tokens and the end of the hit, see ``matched_tokens``)."""
    check_alignment(chunk_size, block_size)
    for name, v in (("start", load_start), ("end", load_end)):
        if v % block_size:
            raise ValueError(f"a load must {name} on a block boundary ({block_size}), got {v}")
    if not 0 <= load_start <= load_end:
        raise ValueError(f"bad load range [{load_start}, {load_end})")
    spans = []
    for index in range(load_start // chunk_size, -(-load_end // chunk_size)):
        start = index * chunk_size
        end = start + chunk_size
        spans.append(ChunkSpan(index, start, end, max(start, load_start), min(end, load_end)))
    return spans


def span_block_ids(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The ids of the blocks holding tokens ``[start, end)`` (both block aligned) in a request's
    block table; ValueError if the table is too short (vLLM allocated fewer blocks)."""
    if start % block_size or end % block_size or not 0 <= start <= end:
        raise ValueError(
            f"[{start}, {end}) is not a block-aligned token range (block size {block_size})"
        )
    first, last = start // block_size, end // block_size
    if last > len(block_ids):
        raise ValueError(
            f"tokens [{start}, {end}) need blocks up to {last}, the request has {len(block_ids)}"
        )
    return [int(b) for b in block_ids[first:last]]


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """vLLM's slot of every token in ``[start, end)``: ``block_ids[t // block_size] * block_size +
    t % block_size`` (what its attention kernels write token ``t`` to)."""
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    if end and (end - 1) // block_size >= len(block_ids):
        raise ValueError(f"token {end - 1} is beyond the request's {len(block_ids)} blocks")
    return [
        int(block_ids[t // block_size]) * block_size + t % block_size for t in range(start, end)
    ]


def kernel_block_ids(
    block_ids: Sequence[int], block_size: int, kernel_block_size: int
) -> list[int]:
    """The kernel blocks of manager blocks ``block_ids``, in token order: manager block ``b`` is
    kernel blocks ``b * r .. b * r + r - 1`` with ``r = block_size // kernel_block_size`` (vLLM's
    ``group_kernel_blocks``)."""
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise AlignmentError(
            f"kernel block size {kernel_block_size} does not divide the block size {block_size}"
        )
    r = block_size // kernel_block_size
    return [int(b) * r + j for b in block_ids for j in range(r)]


def completed_chunks(num_computed_after_step: int, prompt_len: int, chunk_size: int) -> int:
    """How many leading full chunks of the prompt are computed once this step has run (the
    generated tokens are never saved: only the prompt's chunks)."""
    return max(0, min(num_computed_after_step, prompt_len)) // chunk_size
