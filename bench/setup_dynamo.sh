#!/usr/bin/env bash
# Create a separate virtual environment with Dynamo's runtime (PyPI `ai-dynamo-runtime`, Rust in a
# wheel), whose standalone KV indexer (`python -m dynamo.indexer`) the interop test runs against
# kvfuse's KV events (tests/integration/test_dynamo_indexer.py). It runs on the CPU: the indexer
# only subscribes to ZMQ, keeps a radix tree of blocks and answers HTTP queries.
# It is not a kvfuse dependency: it lives in its own venv, outside the package.
#
# Usage: bash bench/setup_dynamo.sh [VENV_DIR]     (default: .baselines/dynamo-venv)
# About 250 MB and a minute. Idempotent: rerunning it on a ready venv only re-checks the pin.
set -euo pipefail

VENV_DIR="${1:-$(cd "$(dirname "$0")/.." && pwd)/.baselines/dynamo-venv}"
PYTHON="${PYTHON:-python3}"
VERSION="${DYNAMO_VERSION:-1.6.1}"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
"$VENV_DIR/bin/python" -m pip install --upgrade pip
# The runtime alone: the `ai-dynamo` meta-package adds the GPU engines' front ends, not needed here.
"$VENV_DIR/bin/python" -m pip install "ai-dynamo-runtime==$VERSION"

# Smoke check: the standalone indexer starts and parses its arguments.
"$VENV_DIR/bin/python" -m dynamo.indexer --help | grep -q -- "--workers"
echo "Dynamo indexer venv ready: $VENV_DIR/bin/python -m dynamo.indexer"
