#!/usr/bin/env bash
# Install what the tests need (scripts/install.sh --test), check the code style (scripts/lint.sh)
# and run the default test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
# One kvfuse home for the whole run: the built-in models are converted into it once.
export KVFUSE_HOME=${KVFUSE_HOME:-$(pwd)/.kvfuse-home}
scripts/install.sh --test
scripts/lint.sh  # ruff (lint, imports, format) and clang-format: CI fails on style before the tests
exec .venv/bin/python -m pytest -m "not slow" -q "$@"
