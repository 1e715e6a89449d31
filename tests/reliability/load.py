"""Helpers of the reliability tests: greedy references with their near-tie gaps, the near-tie rule,
entry forging, a server's RSS, and a thread-safe tally of what a load run saw.

The near-tie rule (as in ``tests/integration/test_batching_real.py``): a cached, batched or
chunked prefill sums in another order than one full prefill, so where the reference's two best
tokens are within float rounding greedy decoding may pick the other one. An answer that differs
from its reference passes only if, at the first differing step, the reference's top-2 logit gap
was below ``NEAR_TIE``.
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass, field

import xxhash
from kvfuse_helpers import greedy_reference  # noqa: F401  (the references of the reliability tests)

from kvfuse.kv.digests import SHA256, layer_digest

NEAR_TIE = 1e-3


# ------------------------------------------------------------------------------ references


def first_difference(got: list[int], ref: list[int]) -> int | None:
    """The first step where ``got`` differs from ``ref`` (a shorter ``got`` that is a prefix of it:
    None)."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return i
    return None if len(got) <= len(ref) else len(ref)


def near_tie_verdict(got: list[int], ref: list[int], gaps: list[float]) -> str:
    """ "same", "near_tie" (differs first where the reference's top-2 gap < NEAR_TIE) or "wrong"."""
    i = first_difference(got, ref)
    if i is None:
        return "same"
    return "near_tie" if i < len(gaps) and gaps[i] < NEAR_TIE else "wrong"


# ------------------------------------------------------------------------------ entry forging

# Offsets in the fixed header "<4sHIHHBB5IIHQ" (kvfuse/kv/format.py).
VERSION, HEADER_LEN, CODEC_ID, CODEC_LEVEL, FLAGS = 4, 6, 10, 12, 15
FIXED = 50


def reseal(
    blob: bytes | bytearray | memoryview,
    fields: dict[int, tuple[str, int]] = (),
    layer_edits: dict[tuple[int, int], int] = (),
) -> bytes:
    """``blob`` with fixed-header fields changed (``{offset: (struct format, value)}``) and payload
    bytes changed (``{(layer, offset in the layer): byte}``), every checksum recomputed (each
    edited layer's in the layer table, and in a signed entry its digest, then the header's): a
    forgery that passes every integrity check, so only what the fields *mean* is tested (and, in a
    signed entry, only the tag, which needs the key, is left wrong)."""
    b = bytearray(blob)
    fields, layer_edits = dict(fields), dict(layer_edits)
    header_len, _, _, _, flags = struct.unpack_from("<IHHBB", b, HEADER_LEN)
    L, _, T = struct.unpack_from("<3I", b, 16)
    key_len = struct.unpack_from("<H", b, 40)[0]
    pos_len = 8 if flags & 1 else 8 * T
    tok_len = 4 * T if flags & 2 else 0
    table = FIXED + key_len + pos_len + tok_len
    sizes = [struct.unpack_from("<Q", b, table + 16 * i)[0] for i in range(L)]
    starts = [header_len + sum(sizes[:i]) for i in range(L)]
    for (layer, off), value in layer_edits.items():
        b[starts[layer] + off] = value
    for layer in {layer for layer, _ in layer_edits}:
        data = bytes(b[starts[layer] : starts[layer] + sizes[layer]])
        if flags & 8:  # a digest id: no xxh3 in the table, the digest alone checks the payload
            struct.pack_into(
                "32s", b, table + 16 * L + 1 + 32 * layer, layer_digest(data, b[table + 16 * L])
            )
        else:
            struct.pack_into("<Q", b, table + 16 * layer + 8, xxhash.xxh3_64_intdigest(data))
            if flags & 4:  # signed before digest ids: SHA-256
                struct.pack_into("32s", b, table + 16 * L + 32 * layer, layer_digest(data, SHA256))
    for offset, (fmt, value) in fields.items():
        struct.pack_into(fmt, b, offset, value)
    struct.pack_into("<Q", b, header_len - 8, xxhash.xxh3_64_intdigest(bytes(b[: header_len - 8])))
    return bytes(b)


def relabel(blob, key) -> bytes:
    """The entry ``blob`` with a header claiming storage key ``key`` (its KV, positions and token ids
    unchanged, every checksum valid): what a writer filing KV under the wrong key produces."""
    from kvfuse.kv.format import Entry, open_entry

    e = open_entry(bytearray(blob))
    return bytes(
        Entry(
            str(key),
            e.codec,
            e.shape,
            e.dtype,
            e.positions,
            e.payload,
            e.layer_sizes,
            token_ids=e.token_ids,
        ).join()
    )


# ------------------------------------------------------------------------------ processes


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS`` in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"^VmRSS:\s+(\d+)\s+kB", f.read(), re.M)
    assert m is not None, f"no VmRSS for pid {pid}"
    return int(m.group(1)) * 1024


# ------------------------------------------------------------------------------ tallies


@dataclass
class Tally:
    """What a load run saw, counted from several client threads."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    requests: dict[str, int] = field(default_factory=dict)  # per kind of request
    same: int = 0
    near_ties: int = 0
    wrong: list[str] = field(default_factory=list)
    status_5xx: list[str] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)
    cached_tokens: int = 0

    def served(self, kind: str, cached: int = 0) -> None:
        with self.lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1
            self.cached_tokens += cached

    def verdict(self, what: str, verdict: str) -> None:
        with self.lock:
            if verdict == "same":
                self.same += 1
            elif verdict == "near_tie":
                self.near_ties += 1
            else:
                self.wrong.append(what)

    def error(self, what: str, status: int | None) -> None:
        with self.lock:
            (self.status_5xx if status is not None and status >= 500 else self.other_errors).append(
                f"{what}: status {status}"
            )

    @property
    def total(self) -> int:
        return sum(self.requests.values())
