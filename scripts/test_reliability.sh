#!/usr/bin/env bash
# The whole reliability suite, slow tests included: fault injection under real servers (Redis
# killed, paused, restarted, slowed and cut; disk entries damaged, a full disk, unreadable
# folders, a server killed in the middle of its writes) and whatever else tests/reliability holds.
# The default test command (scripts/test.sh: pytest -m "not slow") runs only its fast subset.
#
# Some tests need root (a tmpfs for a really full disk; a server without the capabilities that
# bypass file permissions) and skip, saying why, without it. KVFUSE_FAULT_REPORT=FILE appends one
# JSON line of figures per fault test (faults injected, requests served, wrong answers, errors
# counted). Extra arguments go to pytest, e.g. scripts/test_reliability.sh -k redis -x
set -euo pipefail
cd "$(dirname "$0")/.."
# One kvfuse home for the whole run: the built-in models are converted into it once.
export KVFUSE_HOME=${KVFUSE_HOME:-$(pwd)/.kvfuse-home}
scripts/install.sh --test
exec .venv/bin/python -m pytest tests/reliability -q "$@"
