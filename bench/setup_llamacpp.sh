#!/usr/bin/env bash
# Install llama-cpp-python into a virtual environment of its own, used only as a benchmark
# baseline by bench/decode.py (and bench/prefill.py when importable). It is deliberately NOT a
# kvfuse dependency: the benchmark runs it through that venv's interpreter in a subprocess.
#
# Usage: bash bench/setup_llamacpp.sh [VENV_DIR]     (default: .baselines/llama-venv)
#        an existing venv (even kvfuse's .venv) is installed into as it is.
# The CPU build compiles llama.cpp from the sdist: about 5-10 minutes on 2 cores (run under nice).
# CMAKE_ARGS may be set by the caller; the default builds for this CPU (-DGGML_NATIVE=ON).
# llama.cpp's own server (llama-server, the serving baseline of bench/serve.py and
# bench/multiround.py) is built from the same source by bash bench/setup_llama_server.sh.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/llama-venv}"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --upgrade pip
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
nice -n 10 "$VENV_DIR/bin/python" -m pip install --no-cache-dir --verbose "llama-cpp-python==$VERSION" \
    > "$VENV_DIR/llama-cpp-build.log" 2>&1 || { tail -40 "$VENV_DIR/llama-cpp-build.log"; exit 1; }

"$VENV_DIR/bin/python" - <<'PY'
import llama_cpp
print("llama-cpp-python", llama_cpp.__version__, "OK; system info:", llama_cpp.llama_print_system_info().decode())
PY
echo "llama-cpp-python venv ready: $VENV_DIR/bin/python (bench/decode.py finds it there, or pass --llama-python)"
