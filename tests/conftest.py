"""Shared fixtures. Test modules import helpers from this folder (tiny_models, fixtures_redis)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fixtures_redis import redis_server  # noqa: F401  (a real redis-server per test)

torch.set_num_threads(max(1, torch.get_num_threads()))

# The servers the tests start report reuse exactly (their assertions count reused tokens); the
# default, whole chunks unless a request names its conversation, is tested on its own
# (tests/reliability/test_abuse.py, tests/unit/test_disclosure.py).
os.environ.setdefault("KVFUSE_SERVER_CACHED_TOKENS", "exact")

CUDA_TESTS = Path(__file__).parent / "cuda"


def cuda_skip_reason() -> str | None:
    """Why tests marked ``cuda`` cannot run here, or None. ``KVFUSE_TEST_DEVICE=cpu`` runs them
    against the CPU instead: a dry run of the tests' own logic, which proves nothing about CUDA."""
    device = os.environ.get("KVFUSE_TEST_DEVICE", "cuda")
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"no CUDA GPU: torch {torch.__version__} ({build}) reports torch.cuda.is_available() False; "
            "scripts/gpu_check.sh runs these on a GPU (docs/gpu.md)"
        )
    return None


def pytest_collection_modifyitems(config, items):
    """Everything under tests/cuda is marked ``cuda``; a ``cuda`` test skips, with the reason,
    where there is no CUDA GPU."""
    reason = cuda_skip_reason()
    for item in items:
        if CUDA_TESTS in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cuda)
        if reason is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function giving the folder of a tiny random model of a family (built once per session)."""
    from tiny_models import build_tiny

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def kvfuse_home(tmp_path_factory):
    """The kvfuse home for tests: ``$KVFUSE_HOME`` when set (CI converts the models into it once),
    else a session temp folder."""
    import os
    from pathlib import Path

    home = os.environ.get("KVFUSE_HOME")
    return Path(home) if home else tmp_path_factory.mktemp("kvfuse-home")


@pytest.fixture(scope="session", autouse=True)
def _export_kvfuse_home(kvfuse_home):
    """Export that home as ``KVFUSE_HOME`` for the whole session, so that code resolving the default
    home (``load_model(name)`` without ``home=``, subprocesses) shares it and models convert once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFUSE_HOME", str(kvfuse_home))
        yield kvfuse_home


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir, tmp_path_factory):
    """A function giving the ``LoadedModel`` of a tiny random family with a word tokenizer (loaded once)."""
    from kvfuse_helpers import tiny_loaded_model, write_word_tokenizer

    tok = write_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"), 512)
    loaded: dict[str, object] = {}

    def get(name: str = "llama"):
        if name not in loaded:
            loaded[name] = tiny_loaded_model(tiny_model_dir(name), tok)
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def cpu_kernels():
    """kvfuse's compiled CPU kernel module (``kvfuse.models.cpu.kernels``). Where a C++ compiler is
    present it must build (a broken build would otherwise leave every step silently on the slow
    path); without one the test is skipped."""
    import shutil

    from kvfuse.config import default_kernels
    from kvfuse.models.cpu import kernels

    if default_kernels() == "off":
        pytest.skip("KVFUSE_KERNELS=off: kvfuse's CPU kernels are switched off")
    module = kernels.get()
    if module is None:
        if shutil.which("g++"):
            pytest.fail("g++ is installed but kvfuse's CPU kernels did not build (see the log)")
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    return module
