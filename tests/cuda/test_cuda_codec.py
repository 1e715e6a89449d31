"""The codecs with KV that lives on a CUDA GPU: a chunk on the device encodes to the very bytes of
its CPU copy (raw, int8, CacheGen), decodes within each codec's bound, and goes back into a device
cache whose continuation computes as the CPU's does from the same KV; the engine on the device
with CacheGen entries, which the CPU engine then reads. Tolerances: ``cuda_helpers``."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, assert_fp32_close, assert_same_or_near_tie, tie_gap
from kvfuse_helpers import long_text

from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.entropy import layer as coded_layer
from kvfuse.generation import SamplingParams
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_entry, open_entry
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

CH = 256


def prompt(tok, n: int) -> list[int]:
    ids = tok.encode_chat(
        [{"role": "user", "content": long_text(8) + "\n\nWhat is the town known for?"}]
    )
    assert len(ids) >= n
    return ids[:n]


def _k_divisors(codec, x: torch.Tensor) -> torch.Tensor:
    """(L, 2, channels): K's channel divisors as CacheGen chooses them (1 elsewhere)."""
    d = torch.ones(x.shape[0], 2, x.shape[-1])
    if not codec.k_cap:
        return d
    for i in range(x.shape[0]):
        words = coded_layer.channel_divisors(x[i, 0].numpy(), codec.k_cap)
        if words is not None:
            d[i, 0] = torch.from_numpy(coded_layer.bf16_to_f32(words))
    return d


def assert_within_codec_bound(name: str, codec, decoded: torch.Tensor, kv: torch.Tensor) -> None:
    """raw: exact; int8: half a step of 1/127 of each (layer, K/V, token) row's abs-max; CacheGen:
    half a step of its bins (the row's abs-max, K's outlier channels divided down first, rounded up
    to bfloat16) times the channel's divisor, plus fp16's own rounding."""
    if name == "raw":
        assert torch.equal(decoded, kv)
        return
    L, _, T, H, D = kv.shape
    x, y = kv.float().reshape(L, 2, T, H * D), decoded.float().reshape(L, 2, T, H * D)
    absmax = x.abs().amax(-1)
    if name == "int8":
        d = torch.ones(L, 2, H * D)
        step = absmax / 127
    else:
        d = _k_divisors(codec, x)
        bins = torch.tensor(codec.layer_bins(L), dtype=torch.float32)  # (L, 2)
        rows = (x / d[:, :, None, :]).abs().amax(-1)
        scale = torch.from_numpy(
            coded_layer.bf16_to_f32(coded_layer.bf16_scales_up(rows.numpy().reshape(-1)))
        )
        step = scale.view(L, 2, T) / (bins[:, :, None] // 2 - 1)
    err = (y - x).abs()
    # + one fp16 rounding of the decoded value
    bound = (step / 2 * (1 + 1e-3))[..., None] * d[:, :, None, :] + (absmax * 2**-10 + 1e-6)[
        ..., None
    ]
    assert (err <= bound).all(), f"{name}: error {float((err - bound).max()):.3g} beyond its bound"


@pytest.mark.parametrize("name", ["raw", "int8", "cachegen"])
def test_a_chunk_on_the_device_encodes_as_its_cpu_copy(name, smollm2_cpu, smollm2_on, device):
    model = smollm2_on(torch.bfloat16)  # CUDA's default compute dtype; the engine's KV is fp16
    runner = model.runner
    ids = prompt(model.tokenizer, CH + 40)
    cache = runner.new_cache(dtype=torch.float16)
    runner.forward(ids, cache, logits="none")
    on_device = KVChunk(
        kv=cache.kv[:, :, :, :CH].transpose(2, 3).contiguous(),
        positions=cache.positions[:CH].clone(),
    )
    assert on_device.kv.device.type == DEVICE.type
    on_cpu = cache.chunk(0, CH)
    codec = get_codec(name).for_model(model.config.layer_types)
    blob = encode_entry(
        on_device, "key", codec, token_ids=torch.tensor(ids[:CH], device=device)
    ).join()
    assert bytes(blob) == bytes(encode_entry(on_cpu, "key", codec, token_ids=ids[:CH]).join())
    entry = open_entry(blob, "key")
    decoded = entry.decode()
    assert decoded.device.type == "cpu" and decoded.dtype == torch.float16
    assert_within_codec_bound(name, codec, decoded, on_cpu.kv)
    assert torch.equal(entry.positions, torch.arange(CH)) and torch.equal(
        entry.token_ids, torch.tensor(ids[:CH])
    )
    # back into a device cache and a CPU one, the rest of the prompt on top: the same logits
    # (float32 on both, from the same decoded KV)
    outs = []
    for r in (smollm2_on(torch.float32).runner, smollm2_cpu.runner):
        reloaded = r.new_cache(dtype=torch.float16)
        reloaded.write(0, decoded, entry.positions)
        outs.append(r.forward(ids[CH:], reloaded, logits="all"))
    assert outs[0].device.type == DEVICE.type
    assert_fp32_close(outs[0], outs[1], f"{name}: continuation over the decoded KV, device vs CPU")


def test_engine_cachegen_entries_written_on_the_device_serve_the_cpu(
    smollm2_cpu, smollm2_on, tmp_path
):
    """The device engine (float32) with CacheGen in memory and on disk: a repeated prompt loads its
    chunks' CacheGen entries; then the CPU engine, over the same disk, reads those entries and
    answers as the device did (up to near-ties), so the bytes a GPU writes are the CPU's format."""
    settings = EngineSettings.of(chunk_size=CH, codec="cachegen", history=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    model = smollm2_on(torch.float32)
    ids = prompt(model.tokenizer, 3 * CH + 50)
    engine = Engine(
        model, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )
    first = engine.generate(ids, params)
    again = engine.generate(ids, params)
    engine.close()
    assert (
        first.cached_tokens == 0
        and again.cached_tokens == 3 * CH
        and set(again.hit_tiers) == {"memory"}
    )
    cpu = Engine(
        smollm2_cpu, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )
    on_cpu = cpu.generate(ids, params)
    assert on_cpu.cached_tokens == 3 * CH and set(on_cpu.hit_tiers) == {"disk"}
    (logits,) = cpu.score(ids, [on_cpu.token_ids])
    cpu.close()
    top = logits.float().topk(2, dim=-1).values
    gaps = (top[:, 0] - top[:, 1]).tolist()
    assert_same_or_near_tie(
        again.token_ids,
        on_cpu.token_ids,
        gaps,
        tie_gap(torch.float32, logits),
        "device answer from CacheGen entries vs the CPU's from the same entries",
    )
