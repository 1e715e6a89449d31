"""vLLM (CPU, bf16) with kvfuse's connector on SmolLM2, restarted in between.

Engine 1 computes two long prompts and saves their full chunks to kvfuse's disk tier. The saved
entries hold what kvfuse's own runner computes for the same tokens (K after RoPE, V), which proves
the layout conversion reads vLLM's blocks the right way round. One entry is then damaged on disk.
Engine 2 (a new process, empty caches, loading layer by layer) gets the same prompts: the first
loads all its chunks from the disk tier (the connector's counters and vLLM's external prefix-cache hits say so) and
answers exactly as engine 1 did; the second hits the damaged entry, which the worker reports as
failed, vLLM recomputes, and the answer is again identical.

Run with ``scripts/test_vllm.sh`` (about 7 minutes: two vLLM start-ups).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.lib.vllm import VLLMServer, connector_config, first_token, metric_total, scrape_metrics
from kvfuse.kv.format import open_entry, parse_header
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.disk.files import key_to_filename

CHUNK = 256
LEN_A, LEN_B = 2300, 1200  # 8 and 4 full chunks; a lookup loads 8 and 4 (the last token is vLLM's)


def _prompts(folder: Path) -> tuple[list[int], list[int]]:
    from kvfuse.models.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = tok.encode(text)
    assert len(ids) > LEN_A + LEN_B + 200
    return ids[:LEN_A], ids[LEN_A + 100 : LEN_A + 100 + LEN_B]


def _disk_keys(path: Path) -> set:
    tier = DiskTier(path, 1 << 40)
    try:
        return set(tier.keys_lru())
    finally:
        tier.close()


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _entry(path: Path, key):
    tier = DiskTier(path, 1 << 40)
    try:
        return open_entry(bytes(tier.get(key)), key)
    finally:
        tier.close()


def _reference_kv(home: Path, ids: list[int]) -> torch.Tensor:
    """kvfuse's own runner's KV of ``ids`` (fp32, keys after RoPE): (layers, 2, tokens, heads, dim)."""
    from kvfuse.models import load_model
    from kvfuse.models.cache import KVCache

    m = load_model("smollm2", home=home, device="cpu", dtype=torch.float32)
    cache = KVCache(m.config, len(ids), torch.float32)
    m.runner.forward(ids, cache, logits="none")
    return cache.chunk(0, len(ids)).kv


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per layer and K/V, the cosine similarity of two (layers, 2, tokens, heads, dim) tensors."""
    a, b = a.float().flatten(2), b.float().flatten(2)
    return torch.nn.functional.cosine_similarity(a, b, dim=2)


def _damage(path: Path, key, layer: int) -> None:
    """Flip one payload byte inside ``layer`` of the entry's file (its header stays intact)."""
    (file,) = list(path.glob(f"*/{key_to_filename(key)}"))
    raw = bytearray(file.read_bytes())
    h = parse_header(raw)
    start, stop = h.layer_span(layer, layer + 1)
    raw[(start + stop) // 2] ^= 0x5A
    file.write_bytes(bytes(raw))


def test_restarted_vllm_loads_chunks_from_the_disk_tier(
    vllm_python, smollm2_folder, kvfuse_home, tmp_path
):
    kv_dir = tmp_path / "kv"
    a, b = _prompts(smollm2_folder)

    def server(n: int) -> VLLMServer:
        # engine 2 loads layer by layer (wait_for_layer_load); the benchmark covers the CPU default
        # (whole entries before the forward pass)
        config = connector_config(
            {"disk_path": str(kv_dir), "memory_bytes": "512MiB", "layerwise": n == 2}
        )
        return VLLMServer(
            smollm2_folder,
            python=vllm_python,
            dtype="bfloat16",
            kv_transfer_config=config,
            log_path=tmp_path / f"vllm-{n}.log",
        )

    # -- engine 1: compute and save -----------------------------------------------------------------
    with server(1) as s1:
        ttft_a1, text_a1, usage = first_token(s1.base_url, a, max_tokens=24)
        assert usage["prompt_tokens"] == LEN_A
        _wait_for(lambda: len(_disk_keys(kv_dir)) == LEN_A // CHUNK, "prompt A's chunks on disk")
        keys_a = _disk_keys(kv_dir)
        _, text_b1, _ = first_token(s1.base_url, b, max_tokens=24)
        _wait_for(
            lambda: len(_disk_keys(kv_dir)) == LEN_A // CHUNK + LEN_B // CHUNK,
            "prompt B's chunks on disk",
        )
        keys_b = _disk_keys(kv_dir) - keys_a
        _wait_for(
            lambda: metric_total(scrape_metrics(s1.url), "vllm:kvfuse_saved_chunks_total") == 12,
            "the saved-chunks counter",
        )
        m1 = scrape_metrics(s1.url)
        assert metric_total(m1, "vllm:kvfuse_loaded_chunks_total") == 0
        assert s1.log_has("kvfuse connector (worker rank 0)") and s1.log_has(
            "per block: K[t,h,d] at"
        )

    # -- the entries hold the model's KV, not a scrambled layout ------------------------------------
    entries_a = {e.positions[0].item(): e for e in (_entry(kv_dir, k) for k in keys_a)}
    assert sorted(entries_a) == [i * CHUNK for i in range(LEN_A // CHUNK)]
    ref = _reference_kv(kvfuse_home, a[: 2 * CHUNK])
    for i in range(2):
        e = entries_a[i * CHUNK]
        assert e.dtype == torch.bfloat16 and e.shape == (30, 2, CHUNK, 3, 64)
        cos = _cosines(e.decode(), ref[:, :, i * CHUNK : (i + 1) * CHUNK])
        assert cos.min() > 0.999, (
            f"chunk {i}: per-layer K/V cosine vs kvfuse's runner {cos.min():.4f}"
        )
        print(
            f"\nchunk {i}: K/V cosine vs kvfuse's fp32 runner, per layer: min {cos.min():.4f}, mean {cos.mean():.4f}"
        )
    damaged = next(k for k in keys_b if _entry(kv_dir, k).positions[0].item() == CHUNK)
    _damage(kv_dir, damaged, layer=12)

    # -- engine 2: a new process, empty caches ------------------------------------------------------
    with server(2) as s2:
        ttft_a2, text_a2, _ = first_token(s2.base_url, a, max_tokens=24)
        _wait_for(
            lambda: metric_total(scrape_metrics(s2.url), "vllm:kvfuse_loaded_chunks_total") > 0,
            "the loaded-chunks counter",
        )
        m2 = scrape_metrics(s2.url)
        assert text_a2 == text_a1
        assert (
            metric_total(m2, "vllm:kvfuse_loaded_chunks_by_tier_total", tier="disk")
            == LEN_A // CHUNK
        )
        assert metric_total(m2, "vllm:kvfuse_loaded_tokens_total") == (LEN_A // CHUNK) * CHUNK
        assert metric_total(m2, "vllm:external_prefix_cache_hits_total") == (LEN_A // CHUNK) * CHUNK
        assert metric_total(m2, "vllm:kvfuse_load_failed_chunks_total") == 0
        assert s2.log_has(
            f"kvfuse: loaded {LEN_A // CHUNK} chunks ({(LEN_A // CHUNK) * CHUNK} tokens)"
        )
        assert s2.log_has("layerwise loads True (set)")

        _, text_b2, _ = first_token(s2.base_url, b, max_tokens=24)
        _wait_for(
            lambda: (
                metric_total(scrape_metrics(s2.url), "vllm:kvfuse_load_failed_chunks_total") == 1
            ),
            "the failed-load counter",
        )
        assert text_b2 == text_b1  # recomputed, not served from the damaged entry
        assert s2.log_has("Recovered from KV load failure")
        assert damaged not in _disk_keys(kv_dir)  # an unusable entry is removed
        print(
            f"\nTTFT of prompt A ({LEN_A} tokens): engine 1 {ttft_a1:.2f} s (computed), "
            f"engine 2 {ttft_a2:.2f} s (loaded from disk)"
        )
