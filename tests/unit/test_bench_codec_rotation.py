"""The pure parts of ``bench/codec.py --part rotation``: the fp8 baseline, the encodings' names,
the summary and the choice of the smallest level within 2% NLL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.codec_rotation import (  # noqa: E402
    family_of,
    fp8_roundtrip,
    parse_encoding,
    smallest_within,
    summarize,
)
from kvfuse.codecs.cachegen import K_CAP, LevelBins  # noqa: E402
from kvfuse.codecs.cachegen_rot import HADAMARD, HADAMARD_SIGNS  # noqa: E402


def test_fp8_roundtrip_keeps_three_mantissa_bits_of_each_row():
    kv = torch.randn(2, 2, 5, 3, 16, dtype=torch.float16)
    out = fp8_roundtrip(kv)
    assert out.dtype == kv.dtype and out.shape == kv.shape
    rel = (out.float() - kv.float()).abs() / kv.float().abs().clamp_min(1e-3)
    big = kv.float().abs() > kv.float().abs().amax(dim=(3, 4), keepdim=True) / 8
    assert (rel[big] <= 2**-4 + 1e-3).all()  # e4m3: half an ulp of a 3-bit mantissa (normals)
    # each row's abs-max is exact (it maps to 448, a float8 value)
    amax = kv.float().abs().amax(dim=(3, 4))
    assert torch.allclose(out.float().abs().amax(dim=(3, 4)), amax, rtol=1e-3)
    assert torch.equal(fp8_roundtrip(torch.zeros(1, 2, 1, 1, 4)), torch.zeros(1, 2, 1, 1, 4))


@pytest.mark.parametrize(
    "encoding, name, bins_level, variant",
    [
        ("cachegen.2", "cachegen", 2, None),
        ("cachegen-rot.3", "cachegen-rot", 3, HADAMARD_SIGNS),
        ("cachegen-rot.1-h", "cachegen-rot", 1, HADAMARD),
        ("int8", "int8", None, None),
    ],
)
def test_parse_encoding(encoding, name, bins_level, variant):
    codec = parse_encoding(encoding, ["full"] * 4)
    assert codec.name == name
    assert getattr(codec, "bins_level", codec.level if bins_level else None) == bins_level
    assert getattr(codec, "variant", None) == variant


def test_parse_encoding_with_and_without_the_k_cap():
    assert parse_encoding("cachegen.2", ["full"] * 4).k_cap is None
    capped = parse_encoding("cachegen.2-cap", ["full"] * 4)
    assert (capped.name, capped.level, capped.k_cap) == ("cachegen", 2, K_CAP)
    assert family_of("cachegen.2-cap") == "cachegen-cap" and family_of("cachegen.2") == "cachegen"


def test_parse_encoding_with_probed_bins():
    codec = parse_encoding("cachegen-rot.k16-8v8-8", ["full"] * 4)
    assert codec.bins == LevelBins(16, 8, 8, 8)


def _acc(nll, nbytes):
    return {"nll": [nll], "kl": [0.0], "bytes": nbytes, "tokens": 10}


def test_summary_and_smallest_within():
    acc = {
        "lossless": {"nll": [2.0], "kl": [0.0], "bytes": 0, "tokens": 0},
        "int8": _acc(2.0, 1000),
        "cachegen.1": _acc(2.1, 200),  # +5%: out
        "cachegen.2": _acc(2.03, 300),  # +1.5%
        "cachegen.3": _acc(2.0, 400),
        "cachegen-rot.1": _acc(2.05, 250),  # +2.5%: out
    }
    res = summarize(acc)
    assert res["cachegen.2"]["ratio_vs_int8"] == pytest.approx(1000 / 300)
    assert res["cachegen.2"]["nll_relative_increase"] == pytest.approx(0.015)
    assert res["lossless"]["bytes_per_token"] is None
    assert smallest_within(res, "cachegen") == "cachegen.2"
    assert smallest_within(res, "cachegen-rot") is None
    assert smallest_within(res, "cachegen", limit=0.10) == "cachegen.1"
