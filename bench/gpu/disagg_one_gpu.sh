#!/usr/bin/env bash
# `runtime serve --disagg` with both roles on ONE GPU (kind nvidia-h200 or nvidia-h100-x1), the KV pools sized from
# free memory (no --max-total-tokens), in one batch:
#  1. colocated `runtime serve` on the GPU: its start-up pool line, the greedy outputs of a varied batch;
#  2. `runtime serve --disagg` on the same GPU (prefill server, then decode server, router): both servers' pool
#     lines, the device memory in use once both are up (nvidia-smi), the same greedy batch through the router,
#     compared token for token with 1, and a short `bench serving` load.
# Results in $OUT (default /tmp/pdlab_disagg_one): pools.json (pages per server, memory), greedy_*.json,
# greedy_compare.json, serving_*.{csv,json} and logs.
set -u
OUT=${OUT:-/tmp/pdlab_disagg_one}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
MODEL=${MODEL:-synthetic:deepseek-r1:4}
PORT=${PORT:-30777}
SERVE=(--model-path "$MODEL" --max-running-requests 32 --max-context-len 4096 --chunked-prefill-size 2048
       --max-prefill-tokens 8192 --page-size 64 --cuda-graph-bs 1 2 4 8 16 32)
. "$(dirname "$0")/provenance.sh"
. "$(dirname "$0")/serve_lib.sh"
record_provenance "$OUT"
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/stages.txt"; }
CLI=($PY -c 'import sys; from pdlab.runtime.cli import main; sys.exit(main(sys.argv[1:]))')
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' serving)


serve() {  # name, extra serve args...
  local name=$1; shift
  stamp "$name: starting"
  "${CLI[@]}" serve "${SERVE[@]}" "$@" --port "$PORT" > "$OUT/serve_$name.txt" 2>&1 &
  local pid=$! url="http://127.0.0.1:$PORT"
  if ! wait_up "$url" "$pid" 420; then
    stamp "$name did not come up"; tail -30 "$OUT/serve_$name.txt"; stop $pid; return 1
  fi
  stamp "$name up"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits > "$OUT/mem_$name.txt"
  grep -E "pages = " "$OUT/serve_$name.txt" > "$OUT/pools_$name.txt"
  timeout 120 $PY -m pdlab.runtime.disagg.greedy_check --base-url "$url" --page-size 64 --chunk 2048 \
    --vocab 129000 --max-new-tokens 32 --out "$OUT/greedy_$name.json" > "$OUT/greedy_$name.txt" 2>&1
  stamp "greedy $name rc=$?"
  timeout 150 "${BENCH[@]}" --base-url "$url" --num-prompts 32 --random-input-len 1024 --random-output-len 64 \
    --max-concurrency 8 --vocab-size 129000 --out "$OUT/serving" --tag "serving_$name" > "$OUT/serving_$name.txt" 2>&1
  stamp "bench serving $name rc=$?"; tail -12 "$OUT/serving_$name.txt"
  stop $pid
}

serve colocated --device cuda
serve disagg --disagg --start-timeout 400
$PY - "$OUT" <<'EOF' > "$OUT/pools.json"
import json, re, sys
out = sys.argv[1]
res = {}
for name in ("colocated", "disagg"):
    try:
        lines = open(f"{out}/pools_{name}.txt").read().splitlines()
        used, total = (int(x) for x in open(f"{out}/mem_{name}.txt").read().split(","))
    except (OSError, ValueError):
        continue
    res[name] = {"pool_lines": lines, "pages": [int(re.search(r"(\d+) pages = ", s).group(1)) for s in lines],
                 "memory_used_MiB": used, "memory_total_MiB": total}
print(json.dumps(res, indent=1))
EOF
cat "$OUT/pools.json"
if [[ -f "$OUT/greedy_colocated.json" && -f "$OUT/greedy_disagg.json" ]]; then
  $PY -m pdlab.runtime.disagg.greedy_check --compare "$OUT/greedy_colocated.json" "$OUT/greedy_disagg.json" \
    > "$OUT/greedy_compare.json"
  stamp "greedy disagg == colocated rc=$?"; cat "$OUT/greedy_compare.json"
fi
stamp "done"
