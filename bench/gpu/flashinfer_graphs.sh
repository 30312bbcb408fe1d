#!/usr/bin/env bash
# flashinfer in the runtime's CUDA-graph decode (re-planned on the host before each replay). PART selects:
#   tests   the GPU tests with flashinfer importable: flashinfer against the fp32 reference (eager and in a replayed
#           graph) and the runtime's (graph decode against eager, retraction), then the same runtime tests without it;
#   perf    decode steps through the graphs, batch $SIZES over a $CONTEXT-token context, plain and overlap schedule,
#           synthetic DeepSeek-R1-shaped model (full width, 4 layers): without flashinfer (pdlab's kernels in the
#           graphs), then with it (flashinfer where the shipped store or the preference picks it);
#   cost    the host time of one re-plan before a replay (bench/gpu/flashinfer_plan_cost.py).
# Results: $OUT.
set -u
PART=${1:-tests}
OUT=${OUT:-/tmp/pdlab_flashinfer_graphs}
PY=${PY:-python3}
MODEL=${MODEL:-synthetic:deepseek-r1:4}
SIZES=${SIZES:-1,8,32,64,128}
CONTEXT=${CONTEXT:-8192}
mkdir -p "$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
perf() {  # NAME
  timeout ${TPERF:-270} $PY -m pdlab.runtime.engine.perf --model-path "$MODEL" --device cuda --batch-sizes "$SIZES" \
    --context "$CONTEXT" --steps 20 --ttft-lens "" --overlap-too --out "$OUT/$1" > "$OUT/$1.txt" 2>&1
  echo "$1 rc=$?"; grep -E "^op mla_decode|captured" "$OUT/$1.txt"; cat "$OUT/$1/decode.csv" 2>/dev/null
}
tests() {  # NAME TEST...
  local name=$1; shift
  timeout ${TTESTS:-280} $PY -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?"; tail -4 "$OUT/$name.txt"
}
case $PART in
  tests)
    (. "$(dirname "$0")/flashinfer_env.sh"
     $PY -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' | tee "$OUT/flashinfer_version.txt"
     tests with_flashinfer tests/attention/test_flashinfer_gpu.py tests/runtime)
    tests without_flashinfer tests/runtime ;;
  perf)
    perf graphs_without_flashinfer
    . "$(dirname "$0")/flashinfer_env.sh"
    perf graphs_with_flashinfer ;;
  cost)
    . "$(dirname "$0")/flashinfer_env.sh"
    $PY -m pdlab.bench.gpu.flashinfer_plan_cost --out "$OUT/plan_cost" > "$OUT/plan_cost.txt" 2>&1
    echo "cost rc=$?"; cat "$OUT/plan_cost/plan_cost.csv" ;;
  *) echo "PART is tests, perf or cost, not $PART" >&2; exit 2 ;;
esac
