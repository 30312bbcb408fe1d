#!/usr/bin/env bash
# MLA attention on one GPU, in one batch: GPU tests, a config sweep of the triton decode kernel at
# the goal shapes (B=128, seqlen 8192, page 64, S_q=1), then `bench attention` at the goal shapes
# (seqlen 1024..16384, 16/128 heads, bf16/fp8) with the default config AND the sweep's best config,
# then a prefill picture. Every step has its own timeout; benches save partial CSVs as they go.
# Results go to $OUT (default /tmp/pdlab_attention) as one archive attention_results.tgz (the device
# machine returns only a handful of files). Run from the repository root.
set -u
OUT=${OUT:-/tmp/pdlab_attention}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' attention --out "$OUT")
B=(--batch 128 --page-size 64 --s-q 1)

timeout ${TTEST:-90} $PY -m pytest -q -m gpu tests/attention -rA --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
tail -15 "$OUT/gpu_tests.txt"; grep -E "fp8 vs unquantised|PASSED|FAILED" "$OUT/gpu_tests.txt" | head -30

# memory-bound: 16 heads, bf16 and fp8 (fp8-only knobs are no-ops on bf16 rows). tile_in_page=0 is the
# per-row page lookup of before; swap_ab=1 the token-major kernel; fp8_reload=1 loads V twice;
# fp8_upcast=once converts the fp8 tile once, where it is loaded (PTX), so both dots read fp16.
R='"BLOCK_H":16,"num_stages":3'
C16=(--config '{}' --config "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"num_splits\":8,\"tile_in_page\":0}")
for cfg in "{$R,\"BLOCK_N\":32,\"num_warps\":4}" "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"num_splits\":4}" \
           "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"num_splits\":16}" "{$R,\"BLOCK_N\":64,\"num_warps\":8}" \
           "{$R,\"BLOCK_N\":64,\"num_warps\":4}" "{\"BLOCK_H\":16,\"num_stages\":2,\"BLOCK_N\":32,\"num_warps\":4}" \
           "{$R,\"BLOCK_N\":32,\"num_warps\":8,\"fp8_compute\":\"fp16\"}" \
           "{$R,\"BLOCK_N\":16,\"num_warps\":4,\"fp8_compute\":\"fp16\"}" \
           "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"fp8_compute\":\"fp16\"}" \
           "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"swap_ab\":1,\"fp8_reload\":1,\"fp8_compute\":\"fp16\"}" \
           "{$R,\"BLOCK_N\":64,\"num_warps\":4,\"swap_ab\":1}" \
           "{$R,\"BLOCK_N\":32,\"num_warps\":4,\"fp8_upcast\":\"once\"}" \
           "{\"BLOCK_H\":16,\"num_stages\":2,\"BLOCK_N\":32,\"num_warps\":4,\"num_splits\":4,\"fp8_upcast\":\"once\"}" \
           "{$R,\"BLOCK_N\":64,\"num_warps\":4,\"fp8_upcast\":\"once\"}"; do C16+=(--config "$cfg"); done
timeout ${T16:-150} "${BENCH[@]}" "${B[@]}" --backend triton --seqlen 8192 --heads 16 --kv-dtype bf16,fp8 --repeats 10 \
  --max-seconds 0.4 --no-reference --name sweep_h16 "${C16[@]}" > "$OUT/sweep_h16.txt" 2>&1
tail -30 "$OUT/sweep_h16.txt"
# compute-bound: 128 heads
C128=(--config '{}')
for cfg in '{"BLOCK_H":64,"BLOCK_N":32,"num_stages":3,"num_warps":8,"tile_in_page":0}' \
           '{"BLOCK_H":64,"BLOCK_N":64,"num_stages":3,"num_warps":8,"swap_ab":1}' \
           '{"BLOCK_H":64,"BLOCK_N":64,"num_stages":3,"num_warps":8}'; do C128+=(--config "$cfg"); done
timeout ${T128:-50} "${BENCH[@]}" "${B[@]}" --backend triton --seqlen 8192 --heads 128 --kv-dtype bf16 --repeats 10 \
  --max-seconds 0.4 --no-reference --name sweep_h128 "${C128[@]}" > "$OUT/sweep_h128.txt" 2>&1
tail -12 "$OUT/sweep_h128.txt"
if [[ ${SWEEP_ONLY:-0} == 1 ]]; then
  tar czf /tmp/attention_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/attention_results.tgz "$OUT/"
  exit 0
fi

best() {  # best config of a sweep CSV (lowest median over its rows), as JSON
  $PY - "$1" <<'PYEOF'
import sys, pandas as pd
try:
    df = pd.read_csv(sys.argv[1]); df = df[df.status == "ok"]
    print(df.groupby("config").median_ms.mean().idxmin())
except Exception:
    print("")
PYEOF
}
for h in 16 128; do
  f="$OUT/sweep_h$h.csv"; [[ -f $f ]] || f="$OUT/sweep_h$h.partial.csv"
  BEST=$(best "$f"); echo "best h$h: $BEST" | tee -a "$OUT/best_configs.txt"
  EXTRA=(); [[ -n $BEST ]] && EXTRA=(--config '{}' --config "$BEST")
  timeout $((h == 16 ? 50 : 55)) "${BENCH[@]}" "${B[@]}" --backend triton,flashmla,flashinfer,torch --seqlen 8192,1024,4096,16384 --heads $h \
    --kv-dtype bf16,fp8 --repeats 15 --max-seconds 0.5 --name mla_decode_goals_h$h "${EXTRA[@]}" \
    > "$OUT/goals_h$h.txt" 2>&1
  tail -25 "$OUT/goals_h$h.txt"
done
timeout 20 "${BENCH[@]}" --op prefill --backend triton,flashinfer,torch --batch 2 --seqlen 4096 --heads 16,128 \
  --kv-dtype bf16 --page-size 64 --repeats 5 --max-seconds 0.5 --name mla_prefill > "$OUT/prefill.txt" 2>&1
tail -8 "$OUT/prefill.txt"
# the device returns only a few files: pack everything into one archive
tar czf /tmp/attention_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/attention_results.tgz "$OUT/"
ls "$OUT"
