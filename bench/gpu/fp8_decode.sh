#!/usr/bin/env bash
# The fp8 MLA decode kernels on one GPU (an H200), in one batch:
#  1. the MLA GPU tests (Gluon fp8 and wide kernels against the torch reference) and the runtime GPU tests
#     (incl. the served 128-head decode, every call against the fp32 reference);
#  2. `bench attention` at 16 heads, bf16 and fp8 pools, B 32/64/128 × seqlen 1024/8192/16384, plus the goal shape
#     at 128 heads (CUDA graphs, error against the torch reference);
#  3. the runtime decode step (synthetic R1, 4 layers, CUDA graphs) at context 8192 for each kv dtype of PERF_KV
#     (default "bf16 fp8").
# Everything lands under $OUT as results.tgz. Run from the repository root.
set -u
OUT=${OUT:-/tmp/pdlab_fp8}
R=/tmp/fp8_results
mkdir -p "$R"
PY=${PY:-python3}
. "$(dirname "$0")/provenance.sh"
record_provenance "$R"
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout ${TEST_TIMEOUT:-260} $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" \
    tests/attention/test_gluon_mla.py tests/attention/test_gluon_mla_wide.py tests/runtime/test_engine_gpu.py \
    > "$R/pytest_gpu.txt" 2>&1
  echo "rc=$?" >> "$R/pytest_gpu.txt"; tail -4 "$R/pytest_gpu.txt"
fi
timeout ${BENCH_TIMEOUT:-170} $PY -m pdlab bench attention --backend triton --batch ${BATCH:-32,64,128} \
  --seqlen ${SEQLEN:-1024,8192,16384} --heads 16 --kv-dtype bf16,fp8 --page-size 64 --s-q 1 --cuda-graph \
  --max-seconds 1.0 --out "$R/attention16" > "$R/bench_attention16.txt" 2>&1
tail -22 "$R/bench_attention16.txt"
timeout 90 $PY -m pdlab bench attention --backend triton,torch --batch 128 --seqlen 8192 --heads 16,128 \
  --kv-dtype bf16,fp8 --page-size 64 --s-q 1 --cuda-graph --max-seconds 1.5 --out "$R/attention_goal" \
  > "$R/bench_attention_goal.txt" 2>&1
tail -8 "$R/bench_attention_goal.txt"
for kv in ${PERF_KV:-bf16 fp8}; do
  timeout 150 $PY -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 32,64,128 \
    --context 8192 --steps 20 --ttft-lens 8192 --kv-dtype $kv --out "$R/perf_8k_$kv" > "$R/perf_8k_$kv.txt" 2>&1
  tail -6 "$R/perf_8k_$kv.txt"
done
tar czf "$OUT/results.tgz" -C "$R" .
