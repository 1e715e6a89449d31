#!/usr/bin/env bash
# The tests that need vLLM (tests/vllm, marked `vllm` and `slow`): a real vLLM CPU server with
# kvfuse's KV connector, restarted in between. Not part of scripts/test.sh / CI: vLLM's install
# (~6 minutes, 3.5 GB) and each server start-up (2-3.5 minutes on 2 cores) do not fit there.
#
# Usage: scripts/test_vllm.sh [pytest args]        (about 7 minutes)
#   VLLM_VENV=/path/to/venv   vLLM's venv (default .baselines/vllm-venv; created by bench/setup_vllm.sh if missing)
#
# kvfuse is installed into vLLM's venv editable and without dependencies (vLLM's torch stays as it
# is), with the few small packages kvfuse imports that vLLM lacks, at the versions of kvfuse's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVFUSE_HOME=${KVFUSE_HOME:-$(pwd)/.kvfuse-home}
VLLM_VENV=${VLLM_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/vllm-venv}
export KVFUSE_VLLM_PYTHON="$VLLM_VENV/bin/python"

if [ ! -x .venv/bin/python ]; then
    scripts/install.sh --test
fi
if ! "$KVFUSE_VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
    bash bench/setup_vllm.sh "$VLLM_VENV"
fi
if ! "$KVFUSE_VLLM_PYTHON" -c "import kvfuse.integrations.vllm.connector" 2>/dev/null; then
    pins=$(.venv/bin/python -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('xxhash', 'blake3', 'redis', 'hiredis', 'constriction', 'gguf')))")
    # shellcheck disable=SC2086
    "$KVFUSE_VLLM_PYTHON" -m pip install -q --no-deps $pins
    "$KVFUSE_VLLM_PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
    "$KVFUSE_VLLM_PYTHON" -c "import torch, vllm, kvfuse.integrations.vllm.connector; print('kvfuse connector importable; torch', torch.__version__)"
fi
exec .venv/bin/python -m pytest -m vllm -q -s tests/vllm "$@"
