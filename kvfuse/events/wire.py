"""vLLM's KV event wire format, field for field (``vllm/distributed/kv_events.py``, vLLM 0.32).

Consumers (vllm-router ``kv_aware``, llm-d's precise prefix-cache scorer, Dynamo's indexer) decode
these bytes with vLLM's own msgspec classes or a port of them, so the classes here repeat vLLM's
names (the class name is each event's tag, under ``"type"``), field order, defaults and struct
options: a batch is a msgpack array ``[ts, events, data_parallel_rank?]`` (``array_like``), an
event a map with its tag, fields equal to their default left out (``omit_defaults``). The
interop test encodes the same events with vLLM's classes and compares the bytes.

Block hashes are ints here (vLLM's ``ExternalBlockHash`` is ``bytes | int``); what kvfuse sends as
hashes is ``events/blocks.py``'s. ``msgspec`` is an optional dependency (``kvfuse[events]``):
only a server started with ``--kv-events`` imports this module.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ``medium`` values. vLLM names the first three (MEDIUM_GPU / MEDIUM_CPU and "DISK" from its
# offloading connectors); vllm-router 0.1.17 credits GPU in full, CPU as its host tier and DISK
# (or STORAGE) as its disk tier. Redis and S3 are shared tiers: their blocks carry ``ownership``
# (the tier's name), which the router scores as its external tier whatever the medium says.
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REDIS = "REDIS"
MEDIUM_S3 = "S3"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[Event]) -> bytes:
    """The msgpack payload of one batch (the third frame of a published message)."""
    return _ENCODER.encode(KVEventBatch(ts=ts, events=events))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into a batch (tests, and the replay check)."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    """The second frame: the batch's sequence number, 8 bytes big-endian (signed: -1 ends a
    replay, as vLLM's ``END_SEQ``)."""
    return seq.to_bytes(8, "big", signed=True)


END_SEQ = seq_bytes(-1)
