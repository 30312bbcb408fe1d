#!/usr/bin/env bash
# Prefill/decode disaggregation on two H200s (kind nvidia-h200-x2), in one batch:
#  1. GPU tests of tests/disagg (CUDA IPC transfer between two GPU processes);
#  2. KV transfer bandwidth for an 8k-token prompt, 61 layers (DeepSeek-R1 KV), page 64, bf16 and fp8:
#     prefill process on cuda:0 -> decode process on cuda:1 through CUDA IPC, against a plain
#     cuda:0 -> cuda:1 copy of the same bytes;
#  3. colocated `runtime serve` on cuda:0 with the synthetic DeepSeek-R1-shaped model: greedy outputs
#     of a varied batch, then `bench serving`;
#  4. `runtime serve --disagg` (prefill cuda:0, decode cuda:1, router): the same greedy batch (compared
#     token for token with 3) and the same `bench serving` load against the router.
# Results in $OUT (default /tmp/pdlab_disagg): kv_transfer_{bf16,fp8}.{json,csv}, greedy_*.json,
# greedy_compare.json, serving_{colocated,disagg}.* and logs. STAGES="tests transfer colocated disagg".
set -u
OUT=${OUT:-/tmp/pdlab_disagg}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
STAGES=${STAGES:-"tests transfer colocated disagg"}
MODEL=${MODEL:-synthetic:deepseek-r1:4}
PORT=${PORT:-30777}
NUM_PROMPTS=${NUM_PROMPTS:-64}
LOAD=(--num-prompts "$NUM_PROMPTS" --random-input-len 2048 --random-output-len 256 --max-concurrency 16
      --vocab-size 129000 --goodput ttft:5000 tpot:50)
SERVE=(--model-path "$MODEL" --max-running-requests 64 --max-context-len 4096 --max-total-tokens 262144
       --chunked-prefill-size 2048 --max-prefill-tokens 8192 --page-size 64
       --cuda-graph-bs 1 2 4 8 16 24 32 40 48 64)
. "$(dirname "$0")/provenance.sh"
. "$(dirname "$0")/serve_lib.sh"
record_provenance "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/stages.txt"; }
CLI=($PY -c 'import sys; from pdlab.runtime.cli import main; sys.exit(main(sys.argv[1:]))')
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' serving)


serve_and_measure() {  # name url pid
  local name=$1 url=$2 pid=$3
  if ! wait_up "$url" "$pid" 300; then stamp "$name did not come up"; tail -30 "$OUT/serve_$name.txt"; return 1; fi
  stamp "$name up"
  timeout 120 $PY -m pdlab.runtime.disagg.greedy_check --base-url "$url" --page-size 64 --chunk 2048 \
    --vocab 129000 --max-new-tokens 32 --out "$OUT/greedy_$name.json" > "$OUT/greedy_$name.txt" 2>&1
  stamp "greedy $name rc=$?"
  timeout 60 "${BENCH[@]}" --base-url "$url" --num-prompts 8 --random-input-len 256 --random-output-len 16 \
    --vocab-size 129000 --out "$OUT/serving" --tag "warmup_$name" > "$OUT/serving_warmup_$name.txt" 2>&1
  timeout 240 "${BENCH[@]}" --base-url "$url" "${LOAD[@]}" --out "$OUT/serving" --tag "serving_$name" \
    > "$OUT/serving_$name.txt" 2>&1
  stamp "bench serving $name rc=$?"; tail -25 "$OUT/serving_$name.txt"
}

if [[ " $STAGES " == *" tests "* ]]; then
  stamp "gpu tests"
  timeout 180 $PY -m pytest -q -m gpu tests/disagg -rA > "$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; tail -5 "$OUT/gpu_tests.txt"
fi

if [[ " $STAGES " == *" transfer "* ]]; then
  for dt in bf16 fp8; do
    stamp "kv transfer $dt"
    timeout 180 $PY -m pdlab.runtime.disagg.bench_transfer --tokens 8192 --layers 61 --page-size 64 \
      --kv-dtype $dt --src cuda:0 --dst cuda:1 --repeats 20 --out "$OUT/transfer_$dt" > "$OUT/transfer_$dt.txt" 2>&1
    stamp "kv transfer $dt rc=$?"; cat "$OUT/transfer_$dt.txt" | tail -3
    cp "$OUT/transfer_$dt/kv_transfer.json" "$OUT/kv_transfer_$dt.json" 2>/dev/null
  done
fi

if [[ " $STAGES " == *" colocated "* ]]; then
  stamp "colocated server on cuda:0"
  CUDA_VISIBLE_DEVICES=0 "${CLI[@]}" serve "${SERVE[@]}" --device cuda --port "$PORT" > "$OUT/serve_colocated.txt" 2>&1 &
  PID=$!
  serve_and_measure colocated "http://127.0.0.1:$PORT" $PID
  stop $PID
fi

if [[ " $STAGES " == *" disagg "* ]]; then
  stamp "disaggregated: prefill cuda:0, decode cuda:1, router"
  "${CLI[@]}" serve --disagg "${SERVE[@]}" --port "$PORT" --start-timeout 400 > "$OUT/serve_disagg.txt" 2>&1 &
  PID=$!
  serve_and_measure disagg "http://127.0.0.1:$PORT" $PID
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/router_metrics.txt" 2>&1
  stop $PID
  if [[ -f "$OUT/greedy_colocated.json" && -f "$OUT/greedy_disagg.json" ]]; then
    $PY -m pdlab.runtime.disagg.greedy_check --compare "$OUT/greedy_colocated.json" "$OUT/greedy_disagg.json" \
      > "$OUT/greedy_compare.json"
    stamp "greedy disagg == colocated rc=$?"; cat "$OUT/greedy_compare.json"
  fi
fi
stamp "done"
