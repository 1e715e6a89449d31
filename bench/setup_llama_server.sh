#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server, `llama-server`, as a serving baseline of
# bench/serve.py and bench/multiround.py (engine `llama.cpp`, started by bench/lib/servers.py).
# It is what a CPU user would otherwise pick: one process, slot prompt caching, --cache-reuse.
#
# Usage: bash bench/setup_llama_server.sh [DIR]     (default: .baselines/llama-server)
#        the binary lands in DIR/bin/llama-server ($KVFUSE_LLAMA_SERVER or --llama-server
#        point the benchmarks at another one).
#
# Source: the very llama.cpp that bench/setup_llamacpp.sh compiles for llama-cpp-python (its PyPI
# sdist vendors the whole llama.cpp tree, tools/server included), so both baselines run the same
# kernels. No PyPI package ships a maintained prebuilt llama-server, and the network reaches PyPI,
# Debian and npm only (bookworm has no llama.cpp package), hence the build: CPU-native
# (-DGGML_NATIVE=ON), static, only the llama-server target, no web UI (it would be fetched from
# the network), no OpenSSL; about 10-15 minutes on 2 cores, under nice. Idempotent: a finished
# build is only re-checked.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.baselines/llama-server}"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$DIR/bin/llama-server"

mkdir -p "$DIR/src" "$DIR/bin"
if [ ! -x "$BIN" ]; then
    if [ ! -f "$SRC/tools/server/server.cpp" ]; then
        "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$DIR/src" \
            "llama-cpp-python==$VERSION"
        tar xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
    fi
    # shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
    cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF ${CMAKE_ARGS:-} > "$DIR/build.log" 2>&1 \
        || { tail -40 "$DIR/build.log"; exit 1; }
    nice -n 10 cmake --build "$DIR/build" --config Release --target llama-server -j "$JOBS" \
        >> "$DIR/build.log" 2>&1 || { tail -40 "$DIR/build.log"; exit 1; }
    cp "$DIR/build/bin/llama-server" "$BIN"
fi

"$BIN" --version 2>&1 | tail -2
echo "llama-server ready: $BIN (bench/serve.py --engines ...,llama.cpp finds it there)"
