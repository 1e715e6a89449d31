"""Signed entries on real SmolLM2 KV: with ``cache.signing_key``, an entry planted in the disk
folder, the Redis keyspace or the S3 bucket (moto) without an accepted signature is never used.

The attack this closes (docs/reliability.md): a writer with access to a shared tier files, under
the key a request looks up, an entry that passes every other check (the right storage key, the
right token ids, positions, dtype and shape, valid checksums) but holds other KV, and steers the
answers of everyone who reuses it. ``test_without_signing_the_forgery_would_be_used`` shows such
an entry is loaded when signing is off (so the tests below prove something); with signing on,
each forgery (unsigned, signed with another key, a signed entry with its payload changed and its
checks resealed, its BLAKE3 digest included, and the genuine KV merely unsigned) is refused when
read, counted by reason (``signature_unsigned`` / ``signature_mismatch``, within
``unusable_entries``), removed, computed instead, and the answer is the cache-free reference (the
near-tie rule of ``load.py``). The entry computed in its place is stored signed and serves the
next request.

Every tier is real: files in a temp folder, a ``redis-server`` per test, one ``moto_server`` for
the module; the memory tier keeps nothing, so every hit is read back from the planted tier.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvfuse_helpers import SENTENCES, load_builtin, long_text
from load import greedy_reference, near_tie_verdict, reseal

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.kv.format import Entry, open_entry, read_header
from kvfuse.kv.keys import prefix_keys
from kvfuse.kv.signing import EntrySigner
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier, RedisTier
from kvfuse_testkit import S3_ENV, LocalS3

pytestmark = pytest.mark.integration

CH = 32
MAX_TOKENS = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
KEY = b"the service's own signing key, 256 bits"
STRANGER = b"a key an attacker made up, also 32 bytes"
TIERS = ["disk", "redis", "s3"]


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin("smollm2")


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("boto3")
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    try:
        server = LocalS3().start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[str, list[int]]:
    """``p``: two whole chunks and a tail (the one whose chunk 1 is forged); ``o``: other text of
    the same length (its chunk 1 is KV at the same positions, of other tokens)."""
    tok = smollm2.tokenizer
    question = tok.encode("\n\nQuestion: Who built the lighthouse?\nAnswer:")
    p = tok.encode(long_text(7))[: 2 * CH + CH // 2 - len(question)] + question
    o = tok.encode(" ".join(reversed(SENTENCES)) * 8)[: len(p)]
    assert len(o) == len(p) and o[CH : 2 * CH] != p[CH : 2 * CH]
    return {"p": p, "o": o}


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    return greedy_reference(smollm2, prompts["p"], MAX_TOKENS)


class Rig:
    """An engine over [memory that keeps nothing, disk, Redis, S3], signing with ``keys``."""

    def __init__(self, model, tmp_path, redis_url: str, s3, keys):
        from kvfuse.tiers.s3 import S3Tier

        self.tiers = {
            "disk": DiskTier(tmp_path / "kv", 1 << 30),
            "redis": RedisTier(redis_url, timeout_s=2.0),
            "s3": S3Tier(
                f"s3://kvfuse-signing/{tmp_path.name}/",
                endpoint_url=s3.endpoint_url,
                region="us-east-1",
                create_bucket=True,
                timeout_s=5.0,
            ),
        }
        self.store = TieredStore(
            MemoryTier(1), list(self.tiers.values()), signer=EntrySigner(keys) if keys else None
        )
        self.engine = Engine(
            model, self.store, EngineSettings.of(chunk_size=CH, history=False, prefetch=False)
        )

    def keys(self, ids: list[int]):
        return prefix_keys(ids, CH, self.engine.namespace())

    def plant(self, tier: str, key, blob: bytes) -> None:
        """Make ``blob`` the only copy of ``key``: written into ``tier``, removed from the others."""
        self.engine.flush()
        for t in self.tiers.values():
            t.delete(key)
        self.tiers[tier].put(key, blob)
        assert bytes(self.tiers[tier].get(key)) == blob

    def counters(self) -> dict[str, int]:
        s = self.store.stats()["store"]
        return {
            "unusable": s["unusable_entries"],
            "unsigned": s["signature_unsigned"],
            "mismatch": s["signature_mismatch"],
            "load_failures": self.engine.stats_snapshot()["chunk_load_failures"],
        }

    def close(self) -> None:
        self.engine.close()
        self.store.close()


@pytest.fixture
def make_rig(smollm2, tmp_path, redis_server, s3):
    rigs = []

    def make(keys=(KEY,)) -> Rig:
        rigs.append(Rig(smollm2, tmp_path, redis_server.url, s3, list(keys)))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def stored_chunk(rig: Rig, ids: list[int], i: int) -> Entry:
    """Run ``ids`` once (nothing cached) and return its chunk ``i`` as the disk holds it."""
    assert rig.engine.generate(ids, GREEDY).cached_tokens == 0
    rig.engine.flush()
    blob = bytes(rig.tiers["disk"].get(rig.keys(ids)[i]))
    signed = rig.store.signer is not None
    # what it wrote
    assert read_header(blob, EntrySigner([KEY])).signature == ("valid" if signed else "unsigned")
    return open_entry(bytearray(blob))


def steering(other: Entry, key, ids: list[int]) -> Entry:
    """``other``'s KV claiming to be the chunk of ``ids`` under ``key``: the right key, token ids,
    positions, dtype and shape, valid checksums; only a signature can tell it apart."""
    return Entry(
        str(key),
        other.codec,
        other.shape,
        other.dtype,
        other.positions,
        other.payload,
        other.layer_sizes,
        token_ids=torch.tensor(ids, dtype=torch.int64),
    )


def forgeries(genuine: Entry, other: Entry, key, ids: list[int]) -> dict[str, tuple[bytes, str]]:
    """What an attacker can write without the key: (bytes, the counter that must refuse them)."""
    forged = steering(other, key, ids)
    resealed = reseal(bytes(genuine.signed(EntrySigner([KEY])).join()), layer_edits={(0, 7): 0x3C})
    return {
        "steering, unsigned": (bytes(forged.join()), "unsigned"),
        "steering, signed with another key": (
            bytes(forged.signed(EntrySigner([STRANGER])).join()),
            "mismatch",
        ),
        "signed, payload changed and resealed": (resealed, "mismatch"),
        "the genuine KV, unsigned": (
            bytes(
                Entry(
                    genuine.key,
                    genuine.codec,
                    genuine.shape,
                    genuine.dtype,
                    genuine.positions,
                    genuine.payload,
                    genuine.layer_sizes,
                    token_ids=genuine.token_ids,
                ).join()
            ),
            "unsigned",
        ),
    }


def test_without_signing_the_forgery_would_be_used(make_rig, prompts):
    """The control: with signing off, the steering entry passes every check and is loaded."""
    rig = make_rig(keys=())
    p, o = prompts["p"], prompts["o"]
    stored_chunk(rig, p, 1)
    other = stored_chunk(rig, o, 1)
    kp = rig.keys(p)
    rig.plant("redis", kp[1], bytes(steering(other, kp[1], p[CH : 2 * CH]).join()))
    before = rig.counters()
    assert rig.engine.generate(p, GREEDY).cached_tokens == 2 * CH  # chunk 1 came from the forgery
    assert rig.counters() == before


@pytest.mark.parametrize("tier", TIERS)
def test_entries_without_an_accepted_signature_are_never_used(make_rig, prompts, reference, tier):
    rig = make_rig()
    p, o = prompts["p"], prompts["o"]
    genuine = stored_chunk(rig, p, 1)
    other = stored_chunk(rig, o, 1)
    kp = rig.keys(p)
    for what, (blob, reason) in forgeries(genuine, other, kp[1], p[CH : 2 * CH]).items():
        rig.plant(tier, kp[1], blob)
        before = rig.counters()
        result = rig.engine.generate(p, GREEDY)
        after = rig.counters()
        # chunk 0 (genuine, signed) reused; the forgery computed
        assert result.cached_tokens == CH, what
        moved = {k: after[k] - before[k] for k in after}
        assert moved == {
            "unusable": 1,
            "unsigned": reason == "unsigned",
            "mismatch": reason == "mismatch",
            "load_failures": 1,
        }, what
        assert near_tie_verdict(result.token_ids, *reference) != "wrong", what
        rig.engine.flush()  # the forgery was removed, and the chunk computed in its place stored, signed
        fresh = rig.tiers[tier].get(kp[1])
        assert (
            fresh is not None and read_header(bytes(fresh), EntrySigner([KEY])).signature == "valid"
        ), what
    hit = rig.engine.generate(p, GREEDY)
    assert hit.cached_tokens == 2 * CH and near_tie_verdict(hit.token_ids, *reference) != "wrong"


def test_entries_of_a_retired_key_are_misses_and_of_a_rotated_one_hits(
    make_rig, prompts, reference
):
    """Rotation on real tiers: entries signed with the old key are hits while it is still accepted
    (listed after the new one), and misses (counted, recomputed) once it is removed."""
    old = make_rig(keys=(STRANGER,))
    p = prompts["p"]
    old.engine.generate(p, GREEDY)
    old.engine.flush()
    old.close()
    rotated = make_rig(keys=(KEY, STRANGER))
    assert rotated.engine.generate(p, GREEDY).cached_tokens == 2 * CH
    rotated.close()
    retired = make_rig(keys=(KEY,))
    result = retired.engine.generate(p, GREEDY)
    counted = retired.counters()
    # every copy refused
    assert result.cached_tokens == 0 and counted["mismatch"] >= 2 and counted["unsigned"] == 0
    assert near_tie_verdict(result.token_ids, *reference) != "wrong"
