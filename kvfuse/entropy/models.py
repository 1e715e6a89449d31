"""The probability models of the symbol streams: discretized Gaussians, two bytes per stream.

A stream is the quantized values of one (layer, K/V, channel) over a chunk's tokens. Storing an
empirical frequency table per stream costs more than it saves at 256-token chunks (a 31-bin table
is ~0.5 bits per value to describe), so each stream picks a member of a fixed family instead:
a Gaussian over the ``A`` symbols with one of ``NUM_SCALES`` log-spaced widths, centred on one of
the symbols. The entry stores the (centre, width) pair per stream. Measured on SmolLM2 and
Gemma3 KV (``bench/codec.py``), the family codes within ~3-4% of each chunk's empirical entropy.

The tables are integer frequencies built once per alphabet size. Encoder and decoder must use
bit-identical tables (on any machine), so the tables are hashed and compared with the hash this
module was written with: a platform whose ``exp`` rounds differently refuses to code
(``ModelsError``) instead of producing entries another machine would decode wrongly.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash

NUM_SCALES = 32
MIN_SIGMA = 0.15
FREQ_TOTAL = 1 << 16  # integer frequencies per table; every symbol keeps at least 1
ALPHABETS = (
    7,
    15,
    31,
    63,
    127,
)  # bins - 1 for bins in 8, 16, 32, 64, 128 (symmetric, zero in the middle)

# xxh3-64 of every alphabet's table, as built on the machine that wrote this module.
_EXPECTED_TABLE_HASH = {
    7: 0x389BF4496E95BAA3,
    15: 0xE0566E8D6A0057DA,
    31: 0xA95292682DFF27E0,
    63: 0x436335331CACDA89,
    127: 0x8DC1CCD931F673,
}

_lock = threading.Lock()
_tables: dict[int, np.ndarray] = {}
_models: dict[int, list] = {}


class ModelsError(RuntimeError):
    """The probability tables on this machine differ from the ones entries are written with."""


def sigmas(alphabet: int) -> np.ndarray:
    """The ``NUM_SCALES`` Gaussian widths (in bins) offered for an alphabet of ``alphabet`` symbols."""
    return np.exp(np.linspace(np.log(MIN_SIGMA), np.log(alphabet), NUM_SCALES))


def build_table(alphabet: int) -> np.ndarray:
    """Integer frequencies ``(NUM_SCALES, alphabet centres, alphabet symbols)``, each row summing
    to ``FREQ_TOTAL`` with every symbol at least 1."""
    if alphabet not in ALPHABETS:
        raise ValueError(f"alphabet {alphabet} is not one of {ALPHABETS}")
    k = np.arange(alphabet, dtype=np.float64)
    sig = sigmas(alphabet)
    d = (k[None, None, :] - k[None, :, None]) / sig[:, None, None]
    dens = np.exp(-0.5 * d * d)
    dens /= dens.sum(axis=-1, keepdims=True)
    spare = FREQ_TOTAL - alphabet  # one count per symbol is given; the rest follows the density
    freq = 1 + np.floor(dens * spare).astype(np.int64)
    # Hand the rounding remainder to the most likely symbol of each row: rows sum exactly.
    short = FREQ_TOTAL - freq.sum(axis=-1)
    top = dens.argmax(axis=-1)
    np.put_along_axis(
        freq, top[..., None], np.take_along_axis(freq, top[..., None], -1) + short[..., None], -1
    )
    return freq.astype(np.int32)


def table_hash(alphabet: int) -> int:
    return xxhash.xxh3_64_intdigest(table(alphabet).tobytes())


def table(alphabet: int) -> np.ndarray:
    """The checked frequency table of ``alphabet`` (built once)."""
    t = _tables.get(alphabet)
    if t is None:
        with _lock:
            t = _tables.get(alphabet)
            if t is None:
                t = build_table(alphabet)
                expected = _EXPECTED_TABLE_HASH.get(alphabet)
                got = xxhash.xxh3_64_intdigest(t.tobytes())
                if expected is not None and got != expected:
                    raise ModelsError(
                        f"cachegen probability tables for {alphabet} symbols differ on this machine "
                        f"(hash {got:#x}, expected {expected:#x}); entries cannot be coded here"
                    )
                _tables[alphabet] = t
    return t


def coder_models(alphabet: int) -> list:
    """``constriction`` categorical models, ``[scale][centre]``, for an alphabet (built once)."""
    ms = _models.get(alphabet)
    if ms is None:
        import constriction

        t = table(alphabet).astype(np.float64) / FREQ_TOTAL
        Categorical = constriction.stream.model.Categorical
        ms = [
            [Categorical(t[s, c], perfect=False) for c in range(alphabet)]
            for s in range(NUM_SCALES)
        ]
        with _lock:
            _models.setdefault(alphabet, ms)
        ms = _models[alphabet]
    return ms


def fit(symbols: np.ndarray, alphabet: int) -> tuple[np.ndarray, np.ndarray]:
    """Per stream (row of ``symbols``, ``(streams, tokens)``), the centre and width index of its
    model: the rounded mean and the width nearest (in log) to the standard deviation. A moment
    fit: within ~1% of the best member of the family, at a fraction of a search's cost."""
    x = symbols.astype(np.float32)
    mean = x.mean(axis=1)
    sd = np.maximum(x.std(axis=1), MIN_SIGMA)
    centre = np.clip(np.rint(mean), 0, alphabet - 1).astype(np.uint8)
    logs = np.log(sigmas(alphabet)).astype(np.float32)
    width = np.abs(np.log(sd)[:, None] - logs[None, :]).argmin(axis=1).astype(np.uint8)
    return centre, width


def ideal_bits(symbols: np.ndarray, centre: np.ndarray, width: np.ndarray, alphabet: int) -> float:
    """The code length in bits the models promise for ``symbols`` (the coder's own bound)."""
    t = table(alphabet)
    f = t[
        width[:, None].astype(np.int64), centre[:, None].astype(np.int64), symbols.astype(np.int64)
    ]
    return float(-np.log2(f / FREQ_TOTAL).sum())
