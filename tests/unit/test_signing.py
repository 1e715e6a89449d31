"""Signed entries: the pure sign / verify rules (table-tested), every read path of the format
(a whole blob, a streamed read, a layer range), the store's two seams (signing what it writes
below memory, checking what it reads back, counted by reason), and the configuration's keys
(one key, a list, a key file; errors that name the fix and never show a key).

Decided and pinned here: a reader without a key reads signed and unsigned entries alike (the
signature is checked only where a key is configured); a reader with a key refuses unsigned
entries ("unsigned") and entries no accepted key signed ("signature"), before their payload is
used; a signed entry whose payload does not match its signed digests is a "signature" refusal too.
Entries are signed with BLAKE3 digests and a digest id (an unknown id is a "signature" refusal);
entries signed with SHA-256 before ids (``LEGACY``, byte for byte what that build wrote) are read
and checked alike. A signed entry's payload is checked by its digests only: no xxh3 pass.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct

import blake3
import pytest
import torch
import xxhash

from kvfuse.codecs import get_codec
from kvfuse.config import CacheConfig, Config, ConfigError, load_config
from kvfuse.config.signing import signer_of
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.digests import BLAKE3, SHA256, Pending, gather, layer_digest, layer_digests
from kvfuse.kv.format import (
    Entry,
    FormatError,
    SignatureError,
    encode_entry,
    open_entry,
    parse_header,
    read_entry,
    read_header,
)
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.kv.signing import MIN_KEY_BYTES, TAG_SIZE, EntrySigner, parse_key_lines
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

OLD, NEW, STRANGER = b"o" * 32, b"n" * 40, b"s" * 32
NS = Namespace("m", "float16", "L3xH2xD8")
KEYS = prefix_keys(list(range(40)), 8, NS)  # 5 chunk keys
HEADER_LEN, FLAGS = 6, 15


def _entry(key=KEYS[0], codec="raw", seed=0) -> Entry:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((3, 2, 8, 2, 8), generator=g).half()
    return encode_entry(KVChunk(kv, torch.arange(8), torch.arange(100, 108)), key, get_codec(codec))


def _reseal(blob: bytes | bytearray) -> bytes:
    """``blob`` with its header checksum recomputed: a change that passes the integrity checks."""
    b = bytearray(blob)
    (hl,) = struct.unpack_from("<I", b, HEADER_LEN)
    struct.pack_into("<Q", b, hl - 8, xxhash.xxh3_64_intdigest(bytes(b[: hl - 8])))
    return bytes(b)


def _flip(blob: bytes, offset: int, reseal: bool = True) -> bytes:
    b = bytearray(blob)
    b[offset] ^= 0x01
    return _reseal(b) if reseal else bytes(b)


def _layer_table(blob: bytes) -> int:
    """Offset of the layer table (contiguous positions and token ids, as ``_entry`` writes)."""
    key_len = struct.unpack_from("<H", blob, 40)[0]
    tokens = struct.unpack_from("<I", blob, 24)[0]
    return 50 + key_len + 8 + 4 * tokens


def _digests_at(blob: bytes) -> int:
    """Offset of a signed entry's layer digests (after its digest id byte, if it has one)."""
    return _layer_table(blob) + 16 * 3 + (1 if blob[FLAGS] & 8 else 0)


def _reseal_layer(blob: bytes, layer: int) -> bytes:
    """``blob`` after a payload change in ``layer``, that layer's checks (its xxh3, or in an entry
    with a digest id its digest) and the header resealed: what a writer without the key can forge."""
    b = bytearray(blob)
    h = parse_header(b)
    data = bytes(b[slice(*h.layer_span(layer, layer + 1))])
    if not b[FLAGS] & 8:  # no digest id: the table's xxh3 checks the payload (signed or not)
        struct.pack_into(
            "<Q", b, _layer_table(blob) + 16 * layer + 8, xxhash.xxh3_64_intdigest(data)
        )
    if b[FLAGS] & 4:
        at = _digests_at(blob) + 32 * layer
        b[at : at + 32] = layer_digest(data, h.algorithm)
    return _reseal(b)


def _resign(blob: bytes, key: bytes = OLD) -> bytes:
    """``blob`` with its tag made again with ``key`` over its (changed) header, and resealed."""
    b = bytearray(blob)
    at = _digests_at(blob) + 32 * 3
    b[at : at + TAG_SIZE] = hmac.new(key, bytes(b[:at]), hashlib.sha256).digest()
    return _reseal(b)


SIGNED = bytes(_entry().signed(EntrySigner([OLD])).join())  # BLAKE3, with a digest id
# SHA-256, as signed before digest ids
LEGACY = bytes(_entry().signed(EntrySigner([OLD]), SHA256).join())
UNSIGNED = bytes(_entry().join())
_h = parse_header(SIGNED)
PAYLOAD_AT = _h.header_len
DIGEST_ID_AT = _layer_table(SIGNED) + 16 * 3
TAG_AT = DIGEST_ID_AT + 1 + 32 * 3
LEGACY_PAYLOAD_AT = parse_header(LEGACY).header_len
POSITIONS_AT = 50 + len(str(KEYS[0]))
TOKENS_AT = POSITIONS_AT + 8


def _payload_forgery(blob: bytes = SIGNED) -> bytes:
    b = bytearray(blob)
    b[parse_header(blob).header_len + 5] ^= 0x40  # layer 0
    return _reseal_layer(b, 0)


def _with_flags(blob: bytes, flags: int) -> bytes:
    """``blob`` with other header flags, resealed."""
    return _reseal(blob[:FLAGS] + bytes([flags]) + blob[FLAGS + 1 :])


def _with_digest_id(algorithm: int, key: bytes | None = OLD) -> bytes:
    """``SIGNED`` with another digest id; its tag made again with ``key`` (None: left as it was)."""
    b = bytearray(SIGNED)
    b[DIGEST_ID_AT] = algorithm
    return _resign(bytes(b), key) if key is not None else _reseal(b)


def _unsigned_flag() -> bytes:
    """The signed entry with its signed flag cleared and its header made consistent again: the
    signature stripped off (a header of the unsigned size, the payload unchanged)."""
    e = open_entry(bytearray(SIGNED))
    return bytes(
        Entry(
            e.key,
            e.codec,
            e.shape,
            e.dtype,
            e.positions,
            e.payload,
            e.layer_sizes,
            token_ids=e.token_ids,
        ).join()
    )


# (what, blob, the reader's keys (None: signing off), the outcome: "ok" or the refusal's reason / error)
CASES = [
    ("right key", SIGNED, [OLD], "ok"),
    ("wrong key", SIGNED, [STRANGER], "signature"),
    ("rotated list: old key still accepted", SIGNED, [NEW, OLD], "ok"),
    ("rotated list: old key removed", SIGNED, [NEW], "signature"),
    (
        "tag truncated (zeroed, resealed)",
        _reseal(SIGNED[: TAG_AT + 16] + bytes(16) + SIGNED[TAG_AT + 32 :]),
        [OLD],
        "signature",
    ),
    ("tag one bit off", _flip(SIGNED, TAG_AT + 31), [OLD], "signature"),
    ("flipped payload byte", _flip(SIGNED, PAYLOAD_AT + 5, reseal=False), [OLD], "signature"),
    ("flipped payload byte, its checksum resealed", _payload_forgery(), [OLD], "signature"),
    ("flipped header byte (a position)", _flip(SIGNED, POSITIONS_AT), [OLD], "signature"),
    ("flipped header byte (a token id)", _flip(SIGNED, TOKENS_AT), [OLD], "signature"),
    (
        "flipped header byte, not resealed",
        _flip(SIGNED, TOKENS_AT, reseal=False),
        [OLD],
        FormatError,
    ),
    ("unsigned entry, signing on", UNSIGNED, [OLD], "unsigned"),
    ("signature stripped, signing on", _unsigned_flag(), [OLD], "unsigned"),
    ("signed entry, signing off", SIGNED, None, "ok"),
    ("unsigned entry, signing off", UNSIGNED, None, "ok"),
    # Signing off checks integrity only: a resealed forgery passes (what signing is for).
    ("flipped payload byte resealed, signing off", _payload_forgery(), None, "ok"),
    (
        "flipped payload byte, signing off",
        _flip(SIGNED, PAYLOAD_AT + 5, reseal=False),
        None,
        FormatError,
    ),
    # The digest id: inside what the tag covers; an unknown one is refused even under a valid tag.
    ("unknown digest id, tag made with the key", _with_digest_id(0x7F), [OLD], "signature"),
    (
        "digest id 0 (SHA-256 is written without an id), tag made with the key",
        _with_digest_id(SHA256),
        [OLD],
        "signature",
    ),
    ("digest id changed, tag not remade", _with_digest_id(0x7F, key=None), [OLD], "signature"),
    ("unknown digest id, signing off", _with_digest_id(0x7F), None, FormatError),
    (
        "digest id flag cleared (resealed)",
        _with_flags(SIGNED, SIGNED[FLAGS] & ~8),
        [OLD],
        "signature",
    ),
    (
        "digest id flag set on a SHA-256 entry (resealed)",
        _with_flags(LEGACY, LEGACY[FLAGS] | 8),
        [OLD],
        "signature",
    ),
    (
        "digest id flag on an unsigned entry",
        _with_flags(UNSIGNED, UNSIGNED[FLAGS] | 8),
        None,
        FormatError,
    ),
    # Entries signed with SHA-256 before digest ids: read and checked as before.
    ("SHA-256 entry, right key", LEGACY, [OLD], "ok"),
    ("SHA-256 entry, rotated list", LEGACY, [NEW, OLD], "ok"),
    ("SHA-256 entry, wrong key", LEGACY, [STRANGER], "signature"),
    (
        "SHA-256 entry, flipped payload byte",
        _flip(LEGACY, LEGACY_PAYLOAD_AT + 5, reseal=False),
        [OLD],
        "signature",
    ),
    (
        "SHA-256 entry, payload forged and its checks resealed",
        _payload_forgery(LEGACY),
        [OLD],
        "signature",
    ),
    ("SHA-256 entry, signing off", LEGACY, None, "ok"),
    ("SHA-256 entry, forged and resealed, signing off", _payload_forgery(LEGACY), None, "ok"),
]


def _outcome(read, blob: bytes, keys):
    signer = EntrySigner(keys) if keys else None
    try:
        read(blob, signer)
    except SignatureError as e:
        return e.reason
    except FormatError:
        return FormatError
    return "ok"


def _whole(blob, signer):
    open_entry(bytearray(blob), KEYS[0], signer=signer)


def _streamed(blob, signer):
    view, pos = memoryview(blob), [0]

    def readinto(buf):
        n = min(len(buf), len(view) - pos[0], 1000)  # short reads, as a file may give
        buf[:n] = view[pos[0] : pos[0] + n]
        pos[0] += n
        return n

    read_entry(readinto, len(blob), KEYS[0], signer=signer)


def _layer_ranges(blob, signer):
    """Every layer read on its own, as ``fetch_layers`` reads a tier: the header, then the layer."""
    h = parse_header(blob, signer)
    for i in range(len(h.layer_sizes)):
        start, stop = h.layer_span(i, i + 1)
        h.decode_layers(memoryview(blob)[start:stop], i, i + 1)


@pytest.mark.parametrize(
    "read", [_whole, _streamed, _layer_ranges], ids=["whole", "streamed", "layers"]
)
@pytest.mark.parametrize("what, blob, keys, expected", CASES, ids=[c[0] for c in CASES])
def test_sign_and_verify(what, blob, keys, expected, read):
    assert _outcome(read, blob, keys) == expected


def test_a_signed_entry_decodes_to_the_same_kv_and_costs_one_digest_per_layer_and_a_tag():
    entry = _entry()
    signed = entry.signed(EntrySigner([OLD]))
    assert signed.payload is entry.payload  # the payload is shared, not copied
    # id, digests, tag, at most one more block
    assert len(signed) - len(entry) <= 1 + 3 * 32 + TAG_SIZE + 64
    got = open_entry(bytearray(signed.join()), KEYS[0], signer=EntrySigner([OLD]))
    assert torch.equal(got.decode(), entry.decode()) and torch.equal(got.token_ids, entry.token_ids)
    h = parse_header(signed.join())
    layers = [entry.layer_bytes(i, i + 1) for i in range(3)]
    assert h.algorithm == BLAKE3 and h.digests == tuple(blake3.blake3(v).digest() for v in layers)
    assert SIGNED[DIGEST_ID_AT] == BLAKE3 and SIGNED[FLAGS] & 12 == 12
    old = parse_header(LEGACY)
    assert old.algorithm == SHA256 and old.digests == tuple(
        hashlib.sha256(v).digest() for v in layers
    )
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        entry.signed(EntrySigner([OLD]), 0x7F)


# What the build before digest ids wrote for ``_golden_entry()`` signed with ``OLD`` (SHA-256 of its bytes).
# Recomputed for key version 3, whose keys (in the header) are longer: the layout is unchanged.
GOLDEN_SHA256_ENTRY = "52512e60b3664a1d9597b53b4febd475805d72d4a89327e7eb7827c7fc814ca6"


def _golden_entry() -> Entry:
    kv = (torch.arange(3 * 2 * 8 * 2 * 8, dtype=torch.float32).reshape(3, 2, 8, 2, 8) / 64).half()
    return encode_entry(
        KVChunk(kv, torch.arange(8), torch.arange(100, 108)), KEYS[0], get_codec("raw")
    )


@pytest.mark.parametrize(
    "read", [_whole, _streamed, _layer_ranges], ids=["whole", "streamed", "layers"]
)
def test_entries_signed_with_sha256_before_digest_ids_still_verify(read):
    """The SHA-256 layout is written byte for byte as the build before digest ids wrote it, and
    such an entry is read (and checked) by this build, with and without a key."""
    blob = bytes(_golden_entry().signed(EntrySigner([OLD]), SHA256).join())
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_SHA256_ENTRY
    assert (
        _outcome(read, blob, [OLD])
        == _outcome(read, blob, [NEW, OLD])
        == _outcome(read, blob, None)
        == "ok"
    )
    assert _outcome(read, blob, [STRANGER]) == "signature"
    got = open_entry(bytearray(blob), KEYS[0], signer=EntrySigner([OLD]))
    assert torch.equal(got.decode(), _golden_entry().decode())
    assert read_header(blob, EntrySigner([OLD])).signature == "valid"


@pytest.mark.parametrize("blob", [SIGNED, LEGACY], ids=["blake3", "sha256"])
@pytest.mark.parametrize(
    "read", [_whole, _streamed, _layer_ranges], ids=["whole", "streamed", "layers"]
)
def test_flipping_any_payload_byte_of_a_signed_entry_is_refused(blob, read):
    start = parse_header(blob).header_len
    for offset in range(start, len(blob)):
        assert _outcome(read, _flip(blob, offset, reseal=False), [OLD]) == "signature", offset
        assert _outcome(read, _flip(blob, offset, reseal=False), None) == FormatError, offset


class _CountedXxh3:
    """``xxhash`` as ``kv/format.py`` sees it, recording the size of every input of xxh3."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def xxh3_64_intdigest(self, data) -> int:
        self.sizes.append(memoryview(data).nbytes)
        return xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize(
    "read", [_whole, _streamed, _layer_ranges], ids=["whole", "streamed", "layers"]
)
def test_a_signed_entry_is_checked_by_its_digests_alone(monkeypatch, read):
    """No xxh3 pass over a signed payload, written (its table's xxh3 fields are zero) or read with
    the key; a damaged payload is still refused, by its signed digests ("signature")."""
    import kvfuse.kv.format as fmt

    counted = _CountedXxh3()
    monkeypatch.setattr(fmt, "xxhash", counted)
    blob = bytes(_entry().signed(EntrySigner([OLD])).join())
    header_len = parse_header(blob).header_len
    # the header's checksum only
    assert blob == SIGNED and counted.sizes and max(counted.sizes) < header_len
    table = struct.unpack_from("<6Q", blob, _layer_table(blob))
    assert table[1::2] == (0, 0, 0) and table[0::2] == _h.layer_sizes
    counted.sizes.clear()
    assert _outcome(read, blob, [OLD]) == "ok"
    assert counted.sizes and max(counted.sizes) < header_len
    damaged = _flip(blob, PAYLOAD_AT + 100, reseal=False)
    assert _outcome(read, damaged, [OLD]) == "signature"
    assert max(counted.sizes) < header_len
    with pytest.raises(SignatureError, match="blake3 digest"):
        open_entry(bytearray(damaged), signer=EntrySigner([OLD]))


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [0],
        [10],
        [3 << 20],
        [197 * 1024] * 30,
        [3 << 20] * 4,
        [1, 0, 700 << 10, 5, 0, 900 << 10],
        [64 << 10] * 9,
    ],
)
@pytest.mark.parametrize("algorithm", [BLAKE3, SHA256], ids=["blake3", "sha256"])
def test_layer_digests_match_one_at_a_time_however_they_are_split(sizes, algorithm):
    g = torch.Generator().manual_seed(len(sizes))
    layers = [
        memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy())
        for n in sizes
    ]
    one = hashlib.sha256 if algorithm == SHA256 else blake3.blake3
    expected = [one(v).digest() for v in layers]
    assert layer_digests(layers, algorithm) == expected
    assert [layer_digest(v, algorithm) for v in layers] == expected
    pending = [Pending(layers[i : i + 2], algorithm) for i in range(0, len(layers), 2)]
    assert gather(pending) == expected
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        layer_digests(layers, 0x7F)


def test_the_signature_is_checked_before_the_key_and_the_payload():
    """A forged header is refused as a signature, not for what it claims (nothing of it is trusted)."""
    other = bytes(_entry(KEYS[1]).join())
    with pytest.raises(SignatureError):
        open_entry(bytearray(other), KEYS[0], signer=EntrySigner([OLD]))
    # a payload cut short: the header is refused before it is read
    with pytest.raises(SignatureError):
        open_entry(bytearray(UNSIGNED[: PAYLOAD_AT + 3]), KEYS[0], signer=EntrySigner([OLD]))


def test_signer_rules():
    s = EntrySigner([NEW, OLD])
    tag = s.sign(b"data")
    assert len(tag) == TAG_SIZE and s.verify(b"data", tag) and not s.verify(b"datA", tag)
    assert EntrySigner([OLD, NEW]).verify(b"data", tag)  # any accepted key, whatever its place
    assert not EntrySigner([OLD]).verify(b"data", tag)
    assert not s.verify(b"data", tag[:16]) and not s.verify(b"data", b"")
    assert repr(s) == "EntrySigner(2 keys)" and "nnn" not in repr(s)
    with pytest.raises(ValueError):
        EntrySigner([])
    with pytest.raises(ValueError, match=f"shorter than {MIN_KEY_BYTES}"):
        EntrySigner([b"short"])
    assert parse_key_lines("# rotation\n\n  k1  \nk2\n#k3\n") == ["k1", "k2"]


def test_inspection_reports_the_signature():
    assert read_header(UNSIGNED).signature == "unsigned"
    assert read_header(SIGNED).signature == "signed"
    assert read_header(SIGNED, EntrySigner([NEW, OLD])).signature == "valid"
    assert read_header(SIGNED, EntrySigner([STRANGER])).signature == "invalid"
    # the table is signed
    assert read_header(_payload_forgery(), EntrySigner([OLD])).signature == "invalid"
    other = read_header(_flip(SIGNED, PAYLOAD_AT + 5, reseal=False), EntrySigner([OLD]))
    # a signed header over another payload
    assert other.signature == "valid" and not other.payload_ok


# ------------------------------------------------------------------------------ the store's seams


def _store(tmp_path, keys=None, **kw):
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    return TieredStore(
        MemoryTier(1 << 30), [disk], signer=EntrySigner(keys) if keys else None, **kw
    ), disk


def test_the_store_signs_what_it_writes_below_memory_and_checks_what_it_reads(tmp_path):
    store, disk = _store(tmp_path, [OLD], stream_levels=(1,), codecs={"disk": get_codec("int8")})
    with store:
        store.put([(KEYS[0], _entry())])
        store.flush()
        # memory: in-process, unsigned
        assert store.memory.get(KEYS[0]).header_size == _entry().header_size
        for key in (
            KEYS[0],
            KEYS[0].encoded_as("cachegen", 1),
        ):  # the re-encoded copy and the variant
            assert read_header(bytes(disk.get(key)), EntrySigner([OLD])).signature == "valid"
        store.memory.clear()
        got = store.fetch([KEYS[0]])[0]
        assert got.tier == "disk" and got.entry.codec.name == "int8"
        assert store.fetch_layers(KEYS[0], 1, 2, None) is not None  # from memory (promoted)
        store.memory.clear()
        assert store.fetch_layers(KEYS[0], 1, 2, None).tier == "disk"
        assert store.fetch_encoded(KEYS[0], "disk", "cachegen.1").variant == "cachegen.1"
        assert store.stats()["store"]["unusable_entries"] == 0


@pytest.mark.parametrize(
    "planted, reason",
    [
        (UNSIGNED, "signature_unsigned"),
        (bytes(_entry().signed(EntrySigner([STRANGER])).join()), "signature_mismatch"),
        (_payload_forgery(), "signature_mismatch"),
        (_with_digest_id(0x7F), "signature_mismatch"),
        (bytes(_entry().signed(EntrySigner([STRANGER]), SHA256).join()), "signature_mismatch"),
        (_payload_forgery(LEGACY), "signature_mismatch"),
    ],
)
@pytest.mark.parametrize("read", ["fetch", "layers", "encoded"])
def test_an_unsigned_or_wrongly_signed_entry_below_memory_is_a_counted_miss(
    tmp_path, planted, reason, read
):
    store, disk = _store(tmp_path, [OLD])
    with store:
        disk.put(KEYS[0], planted)
        if read == "fetch":
            assert store.fetch([KEYS[0]])[0].entry is None
        elif read == "layers":
            assert store.fetch_layers(KEYS[0], 0, 1) is None
        else:
            assert store.fetch_encoded(KEYS[0], "disk") is None
        counters = store.stats()["store"]
        assert counters["unusable_entries"] == 1 and counters[reason] == 1
        assert counters["signature_unsigned"] + counters["signature_mismatch"] == 1
        assert disk.get(KEYS[0]) is None  # removed, like any unusable entry


def test_a_store_without_keys_reads_signed_entries(tmp_path):
    store, disk = _store(tmp_path)
    with store:
        disk.put(KEYS[0], SIGNED)
        assert store.fetch([KEYS[0]])[0].tier == "disk"


def test_rotation_keeps_entries_of_the_old_key_readable(tmp_path):
    """Step 1 of docs/deploy.md's rotation: the new key first (signing), the old one still
    accepted; entries the old key signed stay hits, new ones are signed with the new key."""
    store, disk = _store(tmp_path, [NEW, OLD])
    with store:
        disk.put(KEYS[0], SIGNED)  # signed by OLD
        # before digest ids
        disk.put(KEYS[2], bytes(_entry(KEYS[2]).signed(EntrySigner([OLD]), SHA256).join()))
        store.put([(KEYS[1], _entry(KEYS[1]))])
        store.flush()
        assert read_header(bytes(disk.get(KEYS[1])), EntrySigner([NEW])).signature == "valid"
        assert parse_header(bytes(disk.get(KEYS[1]))).algorithm == BLAKE3  # new entries: BLAKE3
        assert [f.tier for f in store.fetch(KEYS[:3])] == ["disk", "memory", "disk"]
        assert store.stats()["store"]["unusable_entries"] == 0


# ------------------------------------------------------------------------------ configuration

HEX = "ab" * 32  # 64 characters


def test_keys_come_one_way_from_file_env_or_list(tmp_path):
    assert signer_of(CacheConfig()) is None  # off by default
    assert signer_of(CacheConfig(signing_key=HEX)).key_count == 1
    assert signer_of(CacheConfig(signing_keys=(HEX, "cd" * 32))).key_count == 2
    f = tmp_path / "keys"
    f.write_text(f"# new first\n{'cd' * 32}\n\n{HEX}\n")
    f.chmod(0o600)
    assert load_config(env={"KVFUSE_CACHE_SIGNING_KEY_FILE": str(f)}).cache.signing_key_file == str(
        f
    )
    signer = signer_of(CacheConfig(signing_key_file=str(f)))
    tag = signer.sign(b"x")
    assert EntrySigner([("cd" * 32).encode()]).verify(b"x", tag)  # the file's first key signs
    c = load_config(env={"KVFUSE_CACHE_SIGNING_KEYS": f"{HEX},{'cd' * 32}"})
    assert c.cache.signing_keys == (HEX, "cd" * 32)
    assert load_config(overrides={"cache.signing_key": HEX}).cache.signing_key == HEX


@pytest.mark.parametrize(
    "setup, words",
    [
        (
            {"signing_key_file": "{tmp}/missing"},
            ["cache.signing_key_file", "cannot read", "openssl rand -hex 32"],
        ),
        (
            {"signing_key_file": "{tmp}/empty"},
            ["cache.signing_key_file", "holds no key", "openssl rand -hex 32"],
        ),
        (
            {"signing_key": "short-secret-value"},
            ["cache.signing_key", "18 bytes", "at least 32", "openssl rand"],
        ),
        (
            {"signing_keys": [HEX, "short-secret-value"]},
            ["cache.signing_keys", "key number 2", "at least 32"],
        ),
        ({"signing_key": HEX, "signing_key_file": "{tmp}/empty"}, ["one way, not several"]),
    ],
)
def test_bad_keys_are_config_errors_that_name_the_fix_and_never_show_a_key(tmp_path, setup, words):
    (tmp_path / "empty").write_text("# no key yet\n\n")
    cache = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in setup.items()}
    with pytest.raises(ConfigError) as e:
        load_config(overrides={f"cache.{k}": v for k, v in cache.items()})
    for w in words:
        assert w in str(e.value)
    assert "short-secret-value" not in str(e.value) and HEX not in str(e.value)


def test_a_key_is_never_shown_by_the_configuration(tmp_path, caplog):
    c = load_config(overrides={"cache.signing_keys": [HEX, "cd" * 32]})
    assert HEX not in repr(c) and HEX not in str(c) and HEX not in repr(c.engine_settings())
    with pytest.raises(ConfigError) as e:  # a value of the wrong type is not echoed either
        load_config(overrides={"cache.signing_key": {"nested": HEX}})
    assert HEX not in str(e.value)
    f = tmp_path / "keys"
    f.write_text(HEX + "\n")
    f.chmod(0o644)
    from kvfuse.runtime import open_store

    with caplog.at_level(logging.INFO):
        store = open_store(Config(home=str(tmp_path), cache=CacheConfig(signing_key_file=str(f))))
        store.close()
    assert store.signer is not None and "chmod 600" in caplog.text and HEX not in caplog.text
