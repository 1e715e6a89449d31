"""Fixtures of the CUDA tests (everything here is marked ``cuda``, see tests/conftest.py).

Models: SmolLM2's real weights (the kvfuse home's converted ``smollm2``, ``$KVFUSE_HOME``) on the
CPU in float32 (the reference) and on the device in each compute dtype; and the tiny random
models of every family (tests/tiny_models.py), which need no weights. Without SmolLM2's weights
the tests that need them skip, saying so, unless ``KVFUSE_CUDA_REQUIRE_WEIGHTS=1`` (what
scripts/gpu_check.sh sets once it has converted them), where they fail instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_helpers import DEVICE, on_device


@pytest.fixture(scope="session")
def device() -> torch.device:
    if DEVICE.type == "cuda":
        assert torch.cuda.is_available()
        if DEVICE.index is not None:
            torch.cuda.set_device(DEVICE)
    return DEVICE


@pytest.fixture(scope="session")
def smollm2_cpu():
    """SmolLM2 on the CPU in float32: the reference."""
    from kvfuse_helpers import load_builtin, model_home

    from kvfuse.models import CorruptModel, ModelPackageMissing

    try:
        return load_builtin("smollm2")
    except (ModelPackageMissing, CorruptModel, FileNotFoundError) as e:
        why = (
            f"SmolLM2's weights are not in the kvfuse home {model_home()} and cannot be converted here "
            f"({type(e).__name__}: {e}); see docs/gpu.md"
        )
        if os.environ.get("KVFUSE_CUDA_REQUIRE_WEIGHTS") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def smollm2_on(smollm2_cpu, device):
    """dtype -> SmolLM2 on the device in that compute dtype (loaded once each)."""
    loaded: dict[torch.dtype, object] = {}

    def get(dtype: torch.dtype = torch.float32):
        if dtype not in loaded:
            loaded[dtype] = on_device(smollm2_cpu, dtype, device)
        return loaded[dtype]

    yield get
    loaded.clear()


@pytest.fixture(scope="session")
def tiny_on(tiny_loaded, device):
    """(family, dtype) -> that tiny random model on the device; ``tiny_loaded(family)`` is its CPU twin."""
    loaded: dict[tuple[str, torch.dtype], object] = {}

    def get(family: str, dtype: torch.dtype = torch.float32):
        if (family, dtype) not in loaded:
            loaded[family, dtype] = on_device(tiny_loaded(family), dtype, device)
        return loaded[family, dtype]

    return get
