"""Fixtures for the tests that run a real vLLM server with kvfuse's connector.

They need vLLM's own virtual environment (``bash bench/setup_vllm.sh``, default
``.baselines/vllm-venv`` in the checkout; ``$KVFUSE_VLLM_PYTHON`` points at another) with kvfuse installed into it, and
take minutes (each vLLM start-up is 2-3.5 minutes on the 2-core machine): they are marked ``vllm``
and ``slow``, so the default run (``-m "not slow"``) leaves them out. Run them with
``scripts/test_vllm.sh``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lib.vllm import DEFAULT_PYTHON, default_model_path  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's interpreter, once checked to import vLLM and the connector (else the tests skip)."""
    if not Path(DEFAULT_PYTHON).is_file():
        pytest.skip(
            f"no vLLM venv at {DEFAULT_PYTHON}: run bash bench/setup_vllm.sh (or set KVFUSE_VLLM_PYTHON)"
        )
    probe = subprocess.run(
        [DEFAULT_PYTHON, "-c", "import vllm, kvfuse.integrations.vllm.connector"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"vLLM's venv cannot import the connector (run bash bench/setup_vllm.sh): {probe.stderr[-500:]}"
        )
    return DEFAULT_PYTHON


@pytest.fixture(scope="session")
def smollm2_folder(kvfuse_home) -> Path:
    """SmolLM2 converted by kvfuse into an HF folder (what vLLM serves)."""
    from kvfuse_testkit import ensure_model

    ensure_model(kvfuse_home, "smollm2")
    folder = default_model_path(kvfuse_home)
    assert (folder / "config.json").is_file()
    return folder
