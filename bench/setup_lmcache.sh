#!/usr/bin/env bash
# Create a separate virtual environment with LMCache 0.5.6, used only as a benchmark baseline
# by bench/store.py (through bench/lmcache_baseline.py). LMCache is deliberately NOT a kvfuse
# dependency: it lives in its own venv so that its pins (cupy, cuda-python, ...) never touch
# kvfuse's environment.
#
# Usage: bash bench/setup_lmcache.sh [VENV_DIR]     (default: .baselines/lmcache-venv)
# Takes about 3.5 minutes; torch must come first so that pip picks the CPU wheel.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/lmcache-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --upgrade pip
"$VENV_DIR/bin/python" -m pip install torch==2.13.0
"$VENV_DIR/bin/python" -m pip install lmcache==0.5.6

# Smoke check: the storage engine must import on a CPU-only machine (lmcache.cuda_ops need not).
"$VENV_DIR/bin/python" - <<'PY'
import lmcache, torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401
from lmcache.v1.config import LMCacheEngineConfig  # noqa: F401
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector  # noqa: F401
print("lmcache", getattr(lmcache, "__version__", "?"), "torch", torch.__version__, "OK")
PY
echo "LMCache venv ready: $VENV_DIR/bin/python"
