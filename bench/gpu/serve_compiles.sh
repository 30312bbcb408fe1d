#!/usr/bin/env bash
# Does a started server still compile kernels under load? `runtime serve $SERVE_ARGS` (e.g. SERVE_ARGS=--disagg: a
# prefill server, a decode server and the router, whose children log their compiles too; the embedded tiny model
# unless MODEL is set) on the GPU with an empty Triton cache and a hook that logs every kernel compile
# (jit_hook/sitecustomize.py: kernel, warps, stages, constexprs and the pdlab call stack), then RUNS runs of `bench serving` (256 in / 64 out,
# 64 prompts, 16 requests/s, concurrency 16), each with its latency summary and the kernels compiled during it.
# A warm-up that covers what serving launches compiles nothing in run 1. The scheduler logs every step
# (PDLAB_STEP_LOG=steps.jsonl); step_tail.py then names each run's slowest steps. Results in $OUT (default
# /tmp/pdlab_serve_compiles): serve.txt, jit.log, compiled.txt, steps.jsonl, runs.txt, step_tail.txt, serving<N>.txt,
# s<N>/. Run from the repository root
# after `pip install -e .`; ~2 minutes on an H200.
set -u
OUT=${OUT:-/tmp/pdlab_serve_compiles}
RUNS=${RUNS:-2}
PY=${PY:-python3}
PORT=${PORT:-30781}
mkdir -p "$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
export TRITON_CACHE_DIR=$OUT/triton_cache.tmp
rm -rf "$TRITON_CACHE_DIR"
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))')
MODEL_ARGS=()
[[ -n ${MODEL:-} ]] && MODEL_ARGS=(--model-path "$MODEL")
rm -f "$OUT/steps.jsonl" "$OUT/runs.txt"
PDLAB_STEP_LOG=$OUT/steps.jsonl PDLAB_JIT_LOG=$OUT/jit.log PYTHONPATH="$(dirname "$0")/jit_hook:${PYTHONPATH:-}" \
  $PY -c 'import sys; from pdlab.runtime.cli import main; sys.exit(main(sys.argv[1:]))' serve --device cuda \
  --port "$PORT" "${MODEL_ARGS[@]}" ${SERVE_ARGS:-} > "$OUT/serve.txt" 2>&1 &
PID=$!
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break; sleep 1; done
names() { find "$TRITON_CACHE_DIR" -newer "$1" -name '*.json' ! -name '__grp*' | xargs -r grep -ho '"name": *"[^"]*"' \
  | sort | uniq -c; }
echo "after the warm-up: $(find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp*' | wc -l) kernels compiled" \
  > "$OUT/compiled.txt"
for run in $(seq 1 "$RUNS"); do
  touch "$OUT/.mark$run"; echo "== run $run starts $(date +%s.%N)" >> "$OUT/jit.log"; sleep 1
  start=$(date +%s.%N)
  timeout 200 "${BENCH[@]}" serving --base-url "http://127.0.0.1:$PORT" --random-input-len 256 --random-output-len 64 \
    --num-prompts 64 --request-rate 16 --max-concurrency 16 --seed "$run" --out "$OUT/s$run" \
    > "$OUT/serving$run.txt" 2>&1
  echo "run $run $start $(date +%s.%N)" >> "$OUT/runs.txt"
  { echo "== run $run compiled:"; names "$OUT/.mark$run"; } >> "$OUT/compiled.txt"
  echo "run $run"; grep -E "TTFT|TPOT|ITL|E2E|completed" "$OUT/serving$run.txt"
done
kill -TERM $PID
for _ in $(seq 1 20); do kill -0 $PID 2>/dev/null || break; sleep 0.5; done
kill -KILL $PID 2>/dev/null
rm -rf "$TRITON_CACHE_DIR" "$OUT"/.mark*
cat "$OUT/compiled.txt"
$PY "$(dirname "$0")/step_tail.py" "$OUT" | tee "$OUT/step_tail.txt"
