#!/usr/bin/env bash
# The README's commands on a GPU machine, as a new user runs them, at their defaults where the README gives none:
#  1. `bench list`;
#  2. `bench moe --dispatch nvfp4` (the main job: R1 shapes, every runner usable here);
#  3. `bench attention --op prefill` at a small batch (its default backends are the op's own);
#  4. `runtime serve` (the embedded tiny model) on the GPU, then `bench serving` against it without --vocab-size
#     (the prompts' token ids come from the vocab_size GET /v1/models publishes).
# Results go to $OUT (default /tmp/pdlab_readme), each command's output in <step>.txt and stages.txt with the exit
# codes. Run from the repository root after `pip install -e .`; ~4 minutes on an H200.
set -u
OUT=${OUT:-/tmp/pdlab_readme}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
PORT=${PORT:-30779}
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/stages.txt"; }
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))')
CLI=($PY -c 'import sys; from pdlab.runtime.cli import main; sys.exit(main(sys.argv[1:]))')

timeout 120 "${BENCH[@]}" list > "$OUT/list.txt" 2>&1; stamp "bench list rc=$?"
timeout 300 "${BENCH[@]}" moe --dispatch nvfp4 > "$OUT/moe.txt" 2>&1; stamp "bench moe --dispatch nvfp4 rc=$?"
timeout 200 "${BENCH[@]}" attention --op prefill --batch 4 --seqlen 1024,4096 > "$OUT/attention_prefill.txt" 2>&1
stamp "bench attention --op prefill rc=$?"

"${CLI[@]}" serve --device cuda --port "$PORT" > "$OUT/serve.txt" 2>&1 &
PID=$!
up=0
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && { up=1; break; }
  kill -0 $PID 2>/dev/null || break
  sleep 1
done
if [[ $up == 1 ]]; then
  stamp "runtime serve up"
  curl -s "http://127.0.0.1:$PORT/v1/models" > "$OUT/models.json"
  timeout 200 "${BENCH[@]}" serving --base-url "http://127.0.0.1:$PORT" --random-input-len 256 --random-output-len 64 \
    --num-prompts 64 --request-rate 16 --max-concurrency 16 --out "$OUT/serving" > "$OUT/serving.txt" 2>&1
  stamp "bench serving rc=$?"
else
  stamp "runtime serve did not come up"; tail -20 "$OUT/serve.txt"
fi
kill -TERM $PID 2>/dev/null
for _ in $(seq 1 20); do kill -0 $PID 2>/dev/null || break; sleep 0.5; done
kill -KILL $PID 2>/dev/null
cat "$OUT/stages.txt"
