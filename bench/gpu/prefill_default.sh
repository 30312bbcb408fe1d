#!/usr/bin/env bash
# The Triton MLA prefill default against other configs through the public op (bench attention --op prefill,
# DeepSeek-R1 shapes: batch 1/8, 256 new tokens over 0/512/4096 prefix tokens and 2048 over 0/4096, 16 and 128 heads,
# bf16 and fp8 pools, page 64), then the GPU prefill tests (the configs' results against torch).
#
#   OUT=/tmp/pdlab_prefill_default CONFIGS='{"num_splits": 1}' bash bench/gpu/prefill_default.sh
#
# CONFIGS: space-separated JSON configs, each merged over the default, one bench row each beside the default's
# (e.g. the previous default's values). Writes under $OUT: bench/prefill_new{256,2048}.csv (+ JSON, plots),
# tests.txt, bench.log and device/commit/date.
set -u
OUT=${OUT:-/tmp/pdlab_prefill_default}
CONFIGS=${CONFIGS:-'{"num_splits": 1}'}
PY=${PY:-python3}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
args=(--config default)
for c in $CONFIGS; do args+=(--config "$c"); done
for nt in 256 2048; do
  if [[ $nt == 256 ]]; then seq="256,768,4352"; else seq="2048,6144"; fi
  timeout 300 $PY -m pdlab bench attention --op prefill --backend triton --batch 1,8 --new-tokens $nt --seqlen $seq \
    --heads 16,128 --kv-dtype bf16,fp8 "${args[@]}" --repeats 10 --max-seconds 2 \
    --out "$OUT/bench" --name prefill_new$nt >> "$OUT/bench.log" 2>&1
  echo "bench new $nt exit $?" >> "$OUT/bench.log"
done
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention -k prefill > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
grep "exit" "$OUT/bench.log"
