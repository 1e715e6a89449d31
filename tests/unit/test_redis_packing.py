"""The Redis tier's command packing: an ``Entry`` value goes out as its header and payload buffers,
and the bytes sent are exactly what redis-py sends for the joined value."""

from __future__ import annotations

import pytest
import torch
from redis.connection import Encoder, PythonRespSerializer

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import Entry, encode_entry
from kvfuse.tiers.redis.connection import _BUFFER_CUTOFF, _EntryPacker, pack_command

ENCODE = Encoder("utf-8", "strict", False).encode
REDIS_PY = PythonRespSerializer(_BUFFER_CUTOFF, ENCODE)


def _entry(tokens: int):
    kv = torch.randn((2, 2, tokens, 2, 8), generator=torch.Generator().manual_seed(tokens)).half()
    return encode_entry(KVChunk(kv, torch.arange(tokens)), f"key-{tokens}", get_codec("raw"))


SMALL, BIG = _entry(3), _entry(400)  # below and above redis-py's 6000-byte cutoff


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "kvfuse:a", SMALL),
        ("SET", "kvfuse:a", BIG),
        ("SET", "kvfuse:ü", BIG, "PX", 1500),
        ("SET", b"k" * 7000, BIG, "PX", 1),  # a big key: sent as its own buffer, as redis-py does
        ("SET", "k", memoryview(b"v" * 9000), "PX", 5),  # no Entry: still what redis-py sends
        ("CONFIG SET", "maxmemory", SMALL),  # a command name of two words
    ],
)
def test_the_bytes_sent_are_redis_pys_for_the_joined_value(args):
    joined = tuple(a.join() if isinstance(a, Entry) else a for a in args)
    expected = b"".join(bytes(x) for x in REDIS_PY.pack(*joined))
    got = pack_command(args, ENCODE)
    assert b"".join(bytes(x) for x in got) == expected


def test_an_entry_is_sent_from_its_own_memory():
    header, payload = BIG.parts()
    got = pack_command(("SET", "kvfuse:a", BIG, "PX", 10), ENCODE)
    assert len(got) == 4  # command head, header, payload, tail (no join of the payload)
    assert got[2].obj is payload.obj and got[1].tobytes() == bytes(header)


def test_the_packer_leaves_other_commands_to_the_connection_packer():
    calls = []

    class Inner:
        def pack(self, *args):
            calls.append(args)
            return [b"inner"]

    packer = _EntryPacker(Inner(), ENCODE)
    assert packer.pack("GET", "k") == [b"inner"] and calls == [("GET", "k")]
    assert b"".join(bytes(x) for x in packer.pack("SET", "k", SMALL)) == b"".join(
        REDIS_PY.pack("SET", "k", SMALL.join())
    )
