"""EncryptedTier: entries below memory sealed with AES-256-GCM (cache.encryption_key_file).

Pinned here: what lands on disk holds neither the token ids nor any stretch of the plaintext; a
value that does not open (another key, an altered byte, moved under another key, written before
encryption was on) is a counted miss, never an error; rotation (the first key seals, every key
opens); range reads equal slices of the plaintext; signing still works on top (sign, then
encrypt); a bad key file is a ConfigError that names the fix and never shows a key.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvfuse.codecs import get_codec
from kvfuse.config import CacheConfig, Config, ConfigError, load_config
from kvfuse.config.encryption import cipher_of
from kvfuse.events.hub import medium_of
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.encryption import MAGIC, OVERHEAD, BlobCipher, parse_hex_keys
from kvfuse.kv.format import encode_entry
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.kv.signing import EntrySigner
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.encrypted import EncryptedTier

NS = Namespace("m", "float16", "L3xH2xD8")
IDS = list(range(31337, 31337 + 16))
KEYS = prefix_keys(IDS, 8, NS)  # 2 chunk keys
OLD, NEW, STRANGER = b"o" * 32, b"n" * 32, b"s" * 32
HEX = "ab" * 32


def _entry(key=KEYS[0], seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((3, 2, 8, 2, 8), generator=g).half()
    ids = torch.tensor(IDS[:8])
    return encode_entry(KVChunk(kv, ids, torch.arange(8)), key, get_codec("raw"))


def _plain(seed=0) -> bytes:
    return bytes(_entry(seed=seed).join())


def _disk(tmp_path, keys=(OLD,)):
    inner = DiskTier(tmp_path / "kv", 1 << 30)
    return EncryptedTier(inner, BlobCipher(list(keys))), inner


def _files(tmp_path) -> list[bytes]:
    return [p.read_bytes() for p in (tmp_path / "kv").rglob("*.kvf")]


def test_round_trip_through_a_disk_tier_leaves_no_plaintext_on_disk(tmp_path):
    tier, inner = _disk(tmp_path)
    plain = _plain()
    tier.put(KEYS[0], _entry())  # an Entry (header + payload unjoined) is sealed whole
    assert tier.get(KEYS[0]) == plain
    (stored,) = _files(tmp_path)
    assert stored.startswith(MAGIC) and len(stored) == len(plain) + OVERHEAD
    for dtype in (np.int32, np.int64):
        assert np.array(IDS[:8], dtype=dtype).tobytes() not in stored  # the token ids
    assert not any(plain[i : i + 16] in stored for i in range(0, len(plain) - 16, 16))
    assert tier.stats is inner.stats and tier.name == "disk" and tier.contains(KEYS[0])
    assert medium_of(tier) == ("DISK", None)  # KV events see the disk tier through the wrapper
    tier.put_many([(KEYS[1], _plain(1))], expires_at=tier.clock() + 3600)
    assert tier.get_many(KEYS) == [plain, _plain(1)] and tier.expiry(KEYS[1]) is not None


@pytest.mark.parametrize("case", ["wrong_key", "tampered", "moved", "plaintext", "short"])
def test_a_value_that_does_not_open_is_a_counted_miss(tmp_path, case):
    tier, inner = _disk(tmp_path)
    sealed = BlobCipher([OLD]).seal(str(KEYS[0]), _plain())
    planted = {
        "wrong_key": BlobCipher([STRANGER]).seal(str(KEYS[0]), _plain()),
        "tampered": sealed[:-40] + bytes([sealed[-40] ^ 1]) + sealed[-39:],
        "moved": sealed,  # sealed for KEYS[0], filed under KEYS[1]
        "plaintext": _plain(),  # written before encryption was turned on
        "short": MAGIC + b"x" * 10,
    }[case]
    key = KEYS[0] if case != "moved" else KEYS[1]
    inner.put(key, planted)
    before = tier.stats.snapshot()
    assert tier.get(key) is None and tier.get_many([key]) == [None]
    assert tier.read_range(key, 0, 16) is None
    after = tier.stats.snapshot()
    assert after["decrypt_failures"] - before["decrypt_failures"] == 3
    assert after["hits"] == before["hits"] and after["misses"] - before["misses"] == 3
    assert inner.get(key) is not None  # kept: in a shared tier it may be another server's


def test_an_encrypted_value_read_without_encryption_is_refused_by_the_store(tmp_path):
    tier, inner = _disk(tmp_path)
    tier.put(KEYS[0], _entry())
    with TieredStore(MemoryTier(1 << 30), [inner]) as store:  # a server without the key
        assert store.fetch([KEYS[0]])[0].entry is None
        assert store.stats()["store"]["unusable_entries"] == 1


def test_rotation_the_first_key_seals_and_every_key_opens(tmp_path):
    old_tier, inner = _disk(tmp_path, [OLD])
    old_tier.put(KEYS[0], _plain())
    rotated = EncryptedTier(inner, BlobCipher([NEW, OLD]))
    assert rotated.get(KEYS[0]) == _plain()  # the old key still opens
    rotated.put(KEYS[1], _plain(1))
    assert EncryptedTier(inner, BlobCipher([NEW])).get(KEYS[1]) == _plain(1)  # the new one seals
    assert old_tier.get(KEYS[1]) is None and old_tier.stats.decrypt_failures == 1


@pytest.mark.parametrize("start, stop", [(0, 6), (0, 100), (37, 4000), (100, 10**9), (5, 5)])
def test_read_range_equals_slicing_the_plaintext(tmp_path, start, stop):
    tier, _ = _disk(tmp_path)
    tier.put(KEYS[0], _plain())
    assert bytes(tier.read_range(KEYS[0], start, stop)) == _plain()[start:stop]
    assert bytes(tier.read_range(KEYS[0], start, stop)) == _plain()[start:stop]  # the recent one
    tier.put(KEYS[0], _plain(1))  # a write drops the recent value
    assert bytes(tier.read_range(KEYS[0], start, stop)) == _plain(1)[start:stop]
    tier.delete(KEYS[0])
    assert tier.read_range(KEYS[0], start, stop) is None


def test_a_signing_store_over_encrypted_tiers_signs_then_encrypts(tmp_path):
    tier, inner = _disk(tmp_path)
    store = TieredStore(MemoryTier(1 << 30), [tier], signer=EntrySigner([b"k" * 32]))
    with store:
        store.put([(KEYS[0], _entry())])
        store.flush()
        assert _files(tmp_path)[0].startswith(MAGIC)
        store.memory.clear()
        got = store.fetch([KEYS[0]])[0]
        assert got.tier == "disk" and torch.equal(got.entry.decode(), _entry().decode())
        store.memory.clear()
        assert store.fetch_layers(KEYS[0], 1, 2, None).tier == "disk"  # range reads
        assert store.stats()["store"]["unusable_entries"] == 0


def test_the_memory_tier_is_not_wrapped():
    with pytest.raises(ValueError, match="memory tier"):
        EncryptedTier(MemoryTier(1 << 20), BlobCipher([OLD]))


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "text, error",
    [
        (f"{HEX}\n", None),
        (f"# new first\n{'cd' * 32}\n\n  {HEX}  \n", None),
        ("zz" * 32 + "\n", "line 1 is not hexadecimal"),
        (f"# c\n{HEX[:-2]}\n", "line 2 holds 31 bytes"),
        (HEX + "00\n", "line 1 holds 33 bytes"),
    ],
)
def test_parse_hex_keys(text, error):
    if error is None:
        keys = parse_hex_keys(text)
        assert keys[-1] == bytes.fromhex(HEX) and all(len(k) == 32 for k in keys)
    else:
        with pytest.raises(ValueError, match=error):
            parse_hex_keys(text)


@pytest.mark.parametrize(
    "content, words",
    [
        (None, ["cannot read", "openssl rand -hex 32"]),
        ("# no key yet\n\n", ["holds no key", "openssl rand -hex 32"]),
        ("nothex" + HEX + "\n", ["line 1 is not hexadecimal", "64 hex digits"]),
        (HEX[:40] + "\n", ["line 1 holds 20 bytes", "64 hex digits"]),
        (b"\xff\xfe", ["not UTF-8 text"]),
    ],
)
def test_bad_key_files_are_config_errors_that_name_the_fix(tmp_path, content, words):
    f = tmp_path / "enc.keys"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVFUSE_CACHE_ENCRYPTION_KEY_FILE": str(f)})
    for w in ["cache.encryption_key_file", *words]:
        assert w in str(e.value)
    assert HEX not in str(e.value) and HEX[:40] not in str(e.value)


def test_open_store_wraps_the_lower_tiers_only_with_a_key(tmp_path, caplog):
    f = tmp_path / "enc.keys"
    f.write_text(HEX + "\n")
    f.chmod(0o600)
    assert cipher_of(CacheConfig()) is None
    from kvfuse.runtime import open_store

    plain = open_store(Config(home=str(tmp_path / "a")))
    plain.close()
    assert not any(isinstance(t, EncryptedTier) for t in plain.tiers)
    with caplog.at_level(logging.INFO):
        c = Config(home=str(tmp_path / "b"), cache=CacheConfig(encryption_key_file=str(f)))
        store = open_store(c)
        store.close()
    assert isinstance(store.memory, MemoryTier)
    assert store.lower and all(isinstance(t, EncryptedTier) for t in store.lower)
    assert "encrypted" in caplog.text and HEX not in caplog.text and HEX not in repr(store.lower)
