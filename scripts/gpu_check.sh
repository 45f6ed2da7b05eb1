#!/usr/bin/env bash
# GPU check: the tests that need CUDA (the device-placement tests, which run on the real GPU where torch sees
# one), then the verifier / KV-cache / decode benchmarks in bf16, each
# table written to OUT. Well under 10 minutes on one H100/H200 (each step is capped by STEP_LIMIT).
#
#   bash scripts/gpu_check.sh [OUT]                      # OUT defaults to gpu_check/<date-time>
#   HEADS="runs/eagle/final runs/medusa/final" bash scripts/gpu_check.sh   # decode with trained heads too
#
# Environment: PYTHON (default python); TARGET (default smollm2-135m when its GGUF is cached under
# $HEADWAY_CACHE, else smollm2-random: its shape with random weights, for machines without network);
# HEADS (head folders for bench_decode; they must match TARGET); STEP_LIMIT (seconds per step, 150).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check/$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-python}
LIMIT=${STEP_LIMIT:-150}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts import infer/ without an install

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: torch sees no CUDA device: run this on a GPU machine with a CUDA build of torch" >&2
    exit 2
fi
mkdir -p "$OUT"
if [ -z "${TARGET:-}" ]; then  # the real default target if its weights are cached here, else its shape
    if $PY -c "import sys; from heads.target import cache_root, SMOLLM2_GGUF; sys.exit(not (cache_root() / 'smollm2' / SMOLLM2_GGUF).is_file())"; then
        TARGET=smollm2-135m
    else
        TARGET=smollm2-random
        echo "note: SmolLM2-135M weights not cached: bench_decode times a random model of its shape" | tee "$OUT/note.txt"
    fi
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/machine.txt" 2>&1

failed=()
step() {  # step NAME COMMAND...: run with a time cap, keep its output in OUT/NAME.txt
    local name=$1; shift
    echo "== $name: $*"
    timeout "$LIMIT" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 3 "$OUT/$name.txt"
    # pytest exit 5 = no test selected (a checkout without GPU tests): not a failure
    if [ $rc -ne 0 ] && ! { [ "$name" = tests_cuda ] && [ $rc -eq 5 ]; }; then failed+=("$name (exit $rc)"); fi
}

step tests_cuda $PY -m pytest -q -rs -p no:cacheprovider -k "cuda or gpu" tests
step bench_verify $PY scripts/bench_verify.py --repeats 3
step bench_kv_cache $PY scripts/bench_kv_cache.py --device cuda --dtype bf16
# shellcheck disable=SC2086  # HEADS is a space-separated list of folders
step bench_decode $PY scripts/bench_decode.py --device cuda --dtype bf16 --target "$TARGET" --per-set 4 --heads ${HEADS:-}

echo "tables in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
