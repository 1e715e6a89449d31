#!/usr/bin/env bash
# The venv of vLLM production-stack's multi-round QA script (bench/vendor/production_stack/, run by
# bench/lmcache_qa.py): openai, pandas and tqdm, which kvfuse does not depend on. About a minute.
#
# Usage: bash bench/setup_lmcache_qa.sh [VENV_DIR]     (default: .baselines/qa-venv)
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/qa-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install -q openai pandas tqdm
"$VENV_DIR/bin/python" -c "import openai, pandas, tqdm; print('qa venv ready:', '$VENV_DIR')"
