#!/usr/bin/env bash
# The code-style checks CI runs before the tests (.ci/run -> scripts/test.sh): ruff's lint (with
# import sorting) and ruff format at 100 columns over the Python, clang-format over the C++.
#   scripts/lint.sh          check; exits non-zero naming what differs
#   scripts/lint.sh --fix    rewrite the files in place instead
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LINT_BIN:-.venv/bin}
PY_PATHS=(kvfuse kvfuse_testkit bench tests scripts)
CPP=(kvfuse/models/cpu/kernels/*.cpp kvfuse/models/cpu/kernels/*.h)
if [[ "${1:-}" == "--fix" ]]; then
  "$BIN/ruff" check --fix "${PY_PATHS[@]}"
  "$BIN/ruff" format "${PY_PATHS[@]}"
  "$BIN/clang-format" -i "${CPP[@]}"
  exit 0
fi
"$BIN/ruff" check "${PY_PATHS[@]}"
"$BIN/ruff" format --check "${PY_PATHS[@]}"
"$BIN/clang-format" --dry-run --Werror "${CPP[@]}"
echo "lint: clean"
