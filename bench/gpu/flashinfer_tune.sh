#!/usr/bin/env bash
# flashinfer on one GPU, after flashinfer.sh: its GPU tests (exact CSR pages, prefill over the scheduler's capacity in
# parts, fp8 pools), a decode comparison with triton on a KV cache dtype, then `tune attention` over triton AND
# flashinfer on the 48 mla_decode buckets of that cache dtype, merged into a copy of the shipped store, with the served
# check of tuning.sh (runtime + attention GPU tests with flashinfer installed). Results: one archive in $OUT.
#   KV=bf16|fp8 (default bf16)  TOTAL_BUDGET=200 (seconds of tuning)  PREFILL_PARTS=1 (the 32k-token prefill row)
set -u
OUT=${OUT:-/tmp/pdlab_flashinfer_tune}
KV=${KV:-bf16}
PY=${PY:-python3}
. "$(dirname "$0")/flashinfer_env.sh"
timeout ${TTEST:-150} $PY -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_flashinfer_gpu.py -rA \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.txt" | tail -15
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' attention --out "$OUT")
if [[ ${PREFILL_PARTS:-0} == 1 ]]; then
  timeout ${TPRE:-90} "${BENCH[@]}" --op prefill --backend triton,flashinfer --batch 8 --seqlen 4096 --heads 128 \
    --kv-dtype $KV --page-size 64 --repeats 3 --max-seconds 0.5 --name prefill_parts > "$OUT/prefill_parts.txt" 2>&1
  tail -6 "$OUT/prefill_parts.txt"
fi
if [[ ${DECODE_ROWS:-1} == 1 ]]; then
  timeout ${TDEC:-120} "${BENCH[@]}" --backend triton,flashinfer --batch 8,32,128 --seqlen 1024,4096,16384 \
    --heads 16,128 --kv-dtype $KV --page-size 64 --s-q 1 --repeats 20 --max-seconds 0.4 --cuda-graph \
    --name decode_${KV}_graph > "$OUT/decode_${KV}_graph.txt" 2>&1
  tail -8 "$OUT/decode_${KV}_graph.txt"
fi
OUT=$OUT/tune ONLY=att ATT_BACKENDS=triton,flashinfer ATT_KV=$KV ATT_BATCH=1,8,32,64,128,256 \
  ATT_SEQLEN=1024,4096,8192,16384 ATT_HEADS=16,128 MERGE_SHIPPED=1 TOTAL_BUDGET=${TOTAL_BUDGET:-200} \
  bash "$(dirname "$0")/tuning.sh" > "$OUT/tuning_run.txt" 2>&1
tail -25 "$OUT/tuning_run.txt"
