#!/usr/bin/env bash
# Create a separate virtual environment with vllm-router (PyPI `vllm-router`, a Rust binary in a
# wheel), the router the multi-server tests and bench/cluster.py put in front of kvfuse servers.
# It is not a kvfuse dependency: it lives in its own venv, outside the package, so its own pins
# (aiohttp, fastapi, ...) never touch kvfuse's environment.
#
# Usage: bash bench/setup_router.sh [VENV_DIR]     (default: .baselines/router-venv)
# About 90 MB and under a minute. Idempotent: rerunning it on a ready venv only re-checks the pin.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/router-venv}"
PYTHON="${PYTHON:-python3}"
VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --upgrade pip
"$VENV_DIR/bin/python" -m pip install "vllm-router==$VERSION"

# Smoke check: the launcher parses its arguments (the kv_aware flags included).
"$VENV_DIR/bin/vllm-router" --help | grep -q -- "--kv-event-source"
echo "vllm-router venv ready: $VENV_DIR/bin/vllm-router"
