#!/usr/bin/env bash
# flashinfer on one GPU, second step: its GPU tests (exact CSR pages, prefill over the scheduler's capacity in parts),
# the prefill row that overflowed the capacity before, then `tune attention` over triton AND flashinfer on the 48 bf16
# cache buckets of mla_decode (flashinfer takes no fp8 cache), merged into a copy of the shipped store, with the
# served check of tuning.sh (runtime + attention GPU tests with flashinfer installed). Results: one archive in $OUT.
set -u
OUT=${OUT:-/tmp/pdlab_flashinfer_tune}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
. "$(dirname "$0")/flashinfer_env.sh"
timeout ${TTEST:-150} $PY -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_flashinfer_gpu.py -rA \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.txt" | tail -15
timeout ${TPRE:-90} $PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' attention \
  --out "$OUT" --op prefill --backend triton,flashinfer --batch 8 --seqlen 4096 --heads 128 --kv-dtype bf16 \
  --page-size 64 --repeats 3 --max-seconds 0.5 --name prefill_parts > "$OUT/prefill_parts.txt" 2>&1
tail -6 "$OUT/prefill_parts.txt"
OUT=$OUT/tune ONLY=att ATT_BACKENDS=triton,flashinfer ATT_KV=bf16 ATT_BATCH=1,8,32,64,128,256 \
  ATT_SEQLEN=1024,4096,8192,16384 ATT_HEADS=16,128 MERGE_SHIPPED=1 TOTAL_BUDGET=${TOTAL_BUDGET:-200} \
  bash "$(dirname "$0")/tuning.sh" > "$OUT/tuning_run.txt" 2>&1
tail -25 "$OUT/tuning_run.txt"
