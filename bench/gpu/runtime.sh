#!/usr/bin/env bash
# Runtime on one H200, in one batch:
#  1. GPU tests of the runtime (CUDA-graph decode == eager; retraction with page 64 + fp8 on GPU);
#  2. a synthetic DeepSeek-R1-shaped model at full width, 4 layers (1 dense + 3 MoE, NVFP4 experts,
#     random weights): decode throughput at batch 1..256 (context 1024, CUDA graphs on), the share of
#     each decode step spent outside the GPU (host/Python) and in the scheduler, TTFT at 1k and 8k
#     prompt tokens; the same decode sweep eagerly at batch 1 and 64 for comparison;
#  3. `runtime serve` with that model + `bench serving` (2k in / 512 out, concurrency 32, ~3 minutes).
# Results go to $OUT (default /tmp/pdlab_runtime). Run from the repository root. Every stage has
# its own timeout; STAGES="tests perf serve" (default; add "eager" for the graph-less comparison) picks
# stages; SERVE_EXTRA="--no-overlap-schedule" adds serve flags (the overlap schedule is the default). Expect ~7-8 minutes for the default stages
# (model build ~1 min per stage that loads it); split across calls with STAGES if a call is capped.
set -u
OUT=${OUT:-/tmp/pdlab_runtime}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
STAGES=${STAGES:-"tests perf serve"}
MODEL=${MODEL:-synthetic:deepseek-r1:4}
PORT=${PORT:-30777}
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/stages.txt"; }

if [[ " $STAGES " == *" tests "* ]]; then
  stamp "gpu tests"
  timeout 120 $PY -m pytest -q -m gpu tests/runtime -rA --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
  stamp "gpu tests rc=$?"; tail -5 "$OUT/gpu_tests.txt"
fi

if [[ " $STAGES " == *" perf "* ]]; then
  stamp "perf (graphs)"
  PDLAB_STEP_PROFILE=1 timeout 300 $PY -m pdlab.runtime.engine.perf --model-path "$MODEL" --device cuda \
    --batch-sizes 1,2,4,8,16,32,64,128,256 --context 1024 --steps 20 --ttft-lens 1024,8192 --overlap-too --profile-host 64 \
    --out "$OUT/perf" > "$OUT/perf.txt" 2>&1
  stamp "perf rc=$?"; tail -15 "$OUT/perf.txt"
fi

if [[ " $STAGES " == *" eager "* ]]; then
  stamp "perf (eager)"
  PDLAB_STEP_PROFILE=1 timeout 150 $PY -m pdlab.runtime.engine.perf --model-path "$MODEL" --device cuda \
    --batch-sizes 1,64 --context 1024 --steps 10 --ttft-lens "" --disable-cuda-graph \
    --out "$OUT/perf_eager" > "$OUT/perf_eager.txt" 2>&1
  stamp "perf eager rc=$?"; tail -4 "$OUT/perf_eager.txt"
fi

if [[ " $STAGES " == *" serve "* ]]; then
  stamp "serve"
  $PY -c 'import sys; from pdlab.runtime.cli import main; sys.exit(main(sys.argv[1:]))' serve \
    --model-path "$MODEL" --device cuda --port "$PORT" --max-running-requests 64 --max-context-len 4096 \
    --chunked-prefill-size 8192 --max-prefill-tokens 16384 --cuda-graph-bs 1 2 4 8 16 24 32 40 48 64 ${SERVE_EXTRA:-} \
    > "$OUT/serve.txt" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || break
    sleep 1
  done
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; then
    stamp "server up"
    BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' serving)
    timeout 60 "${BENCH[@]}" --base-url "http://127.0.0.1:$PORT" --num-prompts 8 --random-input-len 256 \
      --random-output-len 16 --vocab-size 129000 --out "$OUT/serving" --tag warmup > "$OUT/serving_warmup.txt" 2>&1
    timeout 240 "${BENCH[@]}" --base-url "http://127.0.0.1:$PORT" --num-prompts 96 --random-input-len 2048 \
      --random-output-len 512 --random-range-ratio 1.0 --max-concurrency 32 --request-rate inf \
      --vocab-size 129000 --goodput ttft:5000 tpot:50 --out "$OUT/serving" --tag r1_4l_2k_512_c32 \
      > "$OUT/serving.txt" 2>&1
    stamp "bench serving rc=$?"; tail -16 "$OUT/serving.txt"
    curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/serving/metrics.txt" 2>&1
  else
    stamp "server did not come up"; tail -30 "$OUT/serve.txt"
  fi
  kill $SERVER 2>/dev/null; sleep 2; kill -9 $SERVER 2>/dev/null
  head -20 "$OUT/serve.txt"
fi
stamp "done"
