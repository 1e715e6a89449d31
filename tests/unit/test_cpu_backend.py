"""The CPU backend (``kvfuse.models.cpu.backend``): the choice made once from ``kernels``, device,
compute dtype and ``weights``, and what a loaded runner holds of it. The numbers each path
computes are checked elsewhere (test_batch_kernel, test_pointwise_kernels, test_blocked_linear,
test_quant): here, which path is chosen, where the kernels are built and where not."""

from __future__ import annotations

import pytest
import torch

from kvfuse.models import packed
from kvfuse.models.cpu import backend, kernels
from kvfuse.models.cpu.backend import KernelsUnavailable, select
from kvfuse.models.loader import load_folder

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture
def no_build(monkeypatch):
    """Fail a test that would build (or load) the kernels."""
    monkeypatch.setattr(kernels, "get", lambda: pytest.fail("the kernels were asked for"))


@pytest.fixture
def unbuildable(monkeypatch):
    """The kernels cannot be built on this machine (no compiler)."""
    monkeypatch.setattr(kernels, "get", lambda: None)


@pytest.mark.parametrize(
    "mode,device,dtype,weights,form",
    [
        ("off", "cpu", F32, "auto", "plain"),  # the plain PyTorch path, for measurements
        ("off", "cpu", F32, "int8", "fbgemm-int8"),
        ("auto", "cuda", torch.bfloat16, "auto", "plain"),  # nothing of a GPU model runs on them
        ("auto", "cpu", torch.bfloat16, "auto", "plain"),  # nor of a bf16 CPU model
        ("on", "cpu", torch.bfloat16, "auto", None),  # on: the kernels are built whatever runs
    ],
)
def test_where_the_kernels_are_not_built(monkeypatch, mode, device, dtype, weights, form):
    asked = []
    monkeypatch.setattr(kernels, "get", lambda: asked.append(1) or "a module")
    chosen = select(mode, device, dtype, weights)
    assert bool(asked) == (mode == "on")
    if form is not None:
        assert chosen.kernel is None and chosen.weights == form
        assert chosen.info() == {"kernels": "off", "weights": form, "isa": "none"}


def test_without_the_kernels_auto_falls_back_and_on_is_an_error(unbuildable):
    chosen = select("auto", CPU, F32)
    assert chosen.kernel is None
    assert chosen.weights == ("onednn-fp32" if packed.onednn_available() else "plain")
    assert select("auto", CPU, F32, "int8").weights == "fbgemm-int8"
    assert select("auto", CPU, F32, "int8").int8_implementation == "fbgemm"
    with pytest.raises(KernelsUnavailable, match="kernels: auto"):
        select("on", CPU, F32)


def test_on_is_cpu_only_and_modes_are_checked(no_build):
    with pytest.raises(KernelsUnavailable, match="cuda"):
        select("on", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="auto, on, off"):
        select("fast", CPU, F32)


def test_no_mode_means_the_environment_s(monkeypatch, no_build):
    monkeypatch.setenv("KVFUSE_KERNELS", "0")
    assert select(None, CPU, F32).mode == "off"
    monkeypatch.delenv("KVFUSE_KERNELS")
    assert select(None, "cuda", torch.bfloat16).mode == "auto"


def test_where_they_build_the_projections_go_in_blocks(cpu_kernels):
    fp32, int8 = select("auto", CPU, F32), select("on", CPU, F32, "int8")
    assert fp32.kernel is cpu_kernels and fp32.weights == "blocked-fp32"
    assert int8.weights == "blocked-int8" and int8.int8_implementation == "blocked"
    # bf16 compute with int8 weights: the kernel multiplies the weights, not the activations
    assert select("auto", CPU, torch.bfloat16, "int8").weights == "blocked-int8"


@pytest.mark.parametrize(
    "kernels_setting,weights,info,fused",
    [
        ("auto", "auto", {"kernels": "on", "weights": "blocked-fp32"}, True),
        ("auto", "int8", {"kernels": "on", "weights": "blocked-int8"}, True),
        ("off", "auto", {"kernels": "off", "weights": "plain", "isa": "none"}, False),
        ("off", "int8", {"kernels": "off", "weights": "fbgemm-int8", "isa": "none"}, False),
    ],
)
def test_a_loaded_runner_holds_its_bound_backend(
    cpu_kernels, tiny_model_dir, kernels_setting, weights, info, fused
):
    runner = load_folder(tiny_model_dir("qwen3"), weights=weights, kernels=kernels_setting)
    b = runner.backend
    if info["kernels"] == "on":  # the instruction set the kernels chose on this CPU
        info = {**info, "isa": cpu_kernels.isa()}
    assert b.info() == info and b.mode == kernels_setting
    assert b.fused is fused and (b.stack is not None) is fused
    assert (b.ops is cpu_kernels) is (kernels_setting == "auto")
    assert runner.use_kernels is (kernels_setting != "off")
    runner.use_kernels = False  # the plain PyTorch path for activations; the weights stay
    assert runner.backend.ops is None and not runner.backend.fused and runner.backend.stack is None
    assert runner.backend.weights == info["weights"]


def test_the_attention_kernel_of_a_step_reads_one_kv_dtype(cpu_kernels):
    b = CpuBackendFor(cpu_kernels)
    assert b.step_kernel([torch.float16, torch.float16]) is cpu_kernels
    assert b.step_kernel([torch.bfloat16]) is cpu_kernels
    assert b.step_kernel([torch.float16, torch.float32]) is None  # one dtype per call
    assert b.step_kernel([torch.int8]) is None
    assert backend.CpuBackend().step_kernel([torch.float32]) is None  # no kernels chosen


def CpuBackendFor(module) -> backend.CpuBackend:
    """A float32 CPU backend whose activations run on ``module``."""
    return backend.CpuBackend("auto", module, "blocked-fp32", True, ops=module)


@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_a_long_pass_composes_the_layer_and_computes_the_same(
    cpu_kernels, tiny_model_dir, monkeypatch, weights
):
    """From ``packed.GEMM_ROWS`` rows the fused halves step aside (the products take the GEMM):
    the same logits as the fused path, up to float rounding."""
    runner = load_folder(tiny_model_dir("qwen3"), weights=weights, kernels="auto")
    ids = list(range(3, 43))
    fused = runner.forward(ids, runner.new_cache(len(ids)), logits="all")
    monkeypatch.setattr(packed, "GEMM_ROWS", 8)
    h = torch.zeros(8, runner.config.hidden_size)
    assert (
        runner.backend.project_qkv(runner.config, runner.weights.layers[0], h, None, None) is None
    )
    long = runner.forward(ids, runner.new_cache(len(ids)), logits="all")
    torch.testing.assert_close(long, fused, atol=1e-4, rtol=1e-4)


FLOOR_FLAGS = {"avx", "avx2", "fma", "f16c"}
AVX512_FLAGS = FLOOR_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    "flags,missing,isa",
    [
        (set(), ["avx2", "fma", "f16c"], "none"),  # below the floor: the kernels do not build
        (FLOOR_FLAGS - {"fma"}, ["fma"], "none"),
        (FLOOR_FLAGS, [], "avx2"),
        (FLOOR_FLAGS | {"avx512f", "avx512bw", "avx512vl"}, [], "avx2"),  # DQ too, or AVX2
        (AVX512_FLAGS, [], "avx512"),
        (AVX512_FLAGS | {"avx512_bf16", "amx_bf16"}, [], "avx512"),
    ],
)
def test_the_instruction_set_the_kernels_pick_from_a_cpu_s_flags(monkeypatch, flags, missing, isa):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert kernels.floor_missing(flags) == missing
    assert kernels.isa_for(flags) == isa
    line = kernels.cpu_line(flags)
    assert line.endswith(f"GGUF kernels: {isa}")
    assert ("no avx512_bf16" in line) is ("avx512_bf16" not in flags)


def test_the_python_choice_is_the_one_the_kernels_make_from_cpuid(cpu_kernels):
    assert kernels.isa_for(kernels.cpu_flags()) == cpu_kernels.isa()
