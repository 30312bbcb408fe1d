#!/usr/bin/env bash
# The wide Gluon MLA decode kernel's validation on one GPU (an H200), in one batch:
#  1. re-tune the 128-head mla_decode buckets (ATT_KV, default bf16,fp8; the kernel is their default) into a copy of
#     the shipped store (SKIP_TUNE=1 skips this and the served check; TB1 / TB2 are the two runs' budgets in s);
#  2. the served check with those configs (runtime + attention GPU tests);
#  3. `bench attention` at the goal shapes with the defaults (CUDA graphs, torch reference error);
#  4. the runtime decode step (synthetic R1, 4 layers, CUDA graphs) at context 1024 (SKIP_PERF_1K=1 skips it) and
#     8192 (for each kv dtype of PERF_KV, default bf16);
#  5. `bench moe --dispatch nvfp4 --mode normal` (EP1: the eager experts stage after the contiguous grid bound;
#     SKIP_MOE=1 skips it).
# Everything lands under $OUT as results.tgz (the device machine returns a handful of files). Repository root.
set -u
OUT=${OUT:-/tmp/pdlab_wide}
R=/tmp/wide_results
mkdir -p "$R/t/configs"
PY=${PY:-python3}
. "$(dirname "$0")/provenance.sh"
record_provenance "$R"
cp -r tuning/configs/NVIDIA_H200 "$R/t/configs/"
if [[ ${SKIP_TUNE:-0} != 1 ]]; then
  OUT=$R/t ONLY=att ATT_HEADS=128 ATT_KV=${ATT_KV:-bf16,fp8} ATT_BATCH=1,32,128 ATT_SEQLEN=8192 TOTAL_BUDGET=${TB1:-55} SERVED_CHECK=0 \
    bash bench/gpu/tuning.sh > "$R/tune1.txt" 2>&1
  cp "$R/t/summary.txt" "$R/summary_1.txt" 2>/dev/null
  OUT=$R/t ONLY=att ATT_HEADS=128 ATT_KV=${ATT_KV:-bf16,fp8} ATT_BATCH=8,64 ATT_SEQLEN=1024,16384 TOTAL_BUDGET=${TB2:-55} \
    SERVED_CHECK=0 \
    bash bench/gpu/tuning.sh > "$R/tune2.txt" 2>&1
  cp "$R/t/summary.txt" "$R/summary_2.txt" 2>/dev/null
  tail -12 "$R/summary_2.txt"
  PDLAB_CONFIG_DIR=$R/t/configs timeout 200 $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" \
    tests/runtime/test_engine_gpu.py tests/attention/test_gpu.py tests/attention/test_gluon_mla_wide.py \
    > "$R/served_check.txt" 2>&1
  echo "rc=$?" >> "$R/served_check.txt"; tail -2 "$R/served_check.txt"
fi
export PDLAB_CONFIG_DIR=$R/t/configs
timeout 150 $PY -m pdlab bench attention --backend triton,torch --batch 128 --seqlen 8192 --heads 16,128 \
  --kv-dtype bf16,fp8 --page-size 64 --s-q 1 --cuda-graph --max-seconds 1.5 --out "$R/attention" > "$R/bench_attention.txt" 2>&1
tail -14 "$R/bench_attention.txt"
if [[ ${SKIP_PERF_1K:-0} != 1 ]]; then
  timeout 150 $PY -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 64,256 \
    --context 1024 --steps 20 --ttft-lens 1024 --overlap-too --out "$R/perf_1k" > "$R/perf_1k.txt" 2>&1
  tail -8 "$R/perf_1k.txt"
fi
for kv in ${PERF_KV:-bf16}; do
  timeout 150 $PY -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 32,64,128 \
    --context 8192 --steps 20 --ttft-lens 8192 --kv-dtype $kv --out "$R/perf_8k_$kv" > "$R/perf_8k_$kv.txt" 2>&1
  tail -6 "$R/perf_8k_$kv.txt"
done
if [[ ${SKIP_MOE:-0} != 1 ]]; then
  timeout 200 $PY -m pdlab bench moe --dispatch nvfp4 --mode normal --tokens 1,16,128,4096 --runner triton \
    --out "$R/moe" > "$R/bench_moe.txt" 2>&1
  tail -12 "$R/bench_moe.txt"
fi
tar czf "$OUT/results.tgz" -C "$R" .
