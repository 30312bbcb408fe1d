#!/usr/bin/env bash
# Re-validate the kernels' committed defaults on a 2-GPU H200 machine (kind nvidia-h200-x2), ~5 min:
#   cuda:0 — MLA GPU tests + `bench attention` at the goal shapes (B=128, page 64, S_q=1, seqlen 8192,
#            16/128 heads, bf16/fp8), one row with the backend default and one with the shipped tuned config;
#   cuda:1 — MoE expert runner GPU tests, then the runtime GPU tests;
# Every test runs with the shipped tuned configs, as a user's server does (a tuned entry once broke a served
# fp8 run that the defaults passed).
#   then both — `bench/gpu/moe_ep.sh 2` (EP2 tests incl. the graph-captured low-latency exchange, and
#            `bench moe --ep 2` in both modes).
# Results: $OUT/validate.tgz (+ the moe_ep files). Run from the repository root after `pip install -e .`.
set -u
OUT=${OUT:-/tmp/pdlab_validate}
mkdir -p "$OUT/attention" "$OUT/moe"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PY:-python3}
{ date -u +%Y-%m-%dT%H:%M:%SZ; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/device.txt" 2>&1
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))')

(
  export CUDA_VISIBLE_DEVICES=0
  timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu tests/attention -rA > "$OUT/attention/pytest_gpu.txt" 2>&1
  echo "rc=$?" >> "$OUT/attention/pytest_gpu.txt"
  A=(attention --out "$OUT/attention" --backend triton --batch 128 --page-size 64 --s-q 1 --seqlen 8192 --repeats 20)
  # the backend default, and the shipped tuned config (the default where none matches)
  C=(--config default --config tuned)
  timeout 75 "${BENCH[@]}" "${A[@]}" --heads 16 --kv-dtype bf16,fp8 "${C[@]}" --name defaults_h16 > "$OUT/attention/defaults_h16.txt" 2>&1
  timeout 75 "${BENCH[@]}" "${A[@]}" --heads 128 --kv-dtype bf16,fp8 "${C[@]}" --name defaults_h128 > "$OUT/attention/defaults_h128.txt" 2>&1
) &
ATT=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 210 $PY -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_runners.py tests/moe/test_triton_nvfp4_fast.py tests/moe/test_frag.py \
    > "$OUT/moe/pytest_gpu.txt" 2>&1
  echo "rc=$?" >> "$OUT/moe/pytest_gpu.txt"
  # the runtime on CUDA (experts stored in fragment order in place, CUDA-graph decode == eager, retraction on GPU)
  timeout 150 $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime > "$OUT/moe/pytest_runtime_gpu.txt" 2>&1
  echo "rc=$?" >> "$OUT/moe/pytest_runtime_gpu.txt"
  # served MoE layers with experts stored in place (tiled, fragment order) vs as loaded, on CUDA (CPU CI runs them in the interpreter)
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_stored_experts.py >> "$OUT/moe/pytest_runtime_gpu.txt" 2>&1
  echo "rc=$?" >> "$OUT/moe/pytest_runtime_gpu.txt"
) &
MOE=$!
wait $ATT $MOE
tail -n 3 "$OUT/attention/pytest_gpu.txt" "$OUT/moe/pytest_gpu.txt" "$OUT/moe/pytest_runtime_gpu.txt"
grep -E "triton|shape" "$OUT/attention/defaults_h16.txt" "$OUT/attention/defaults_h128.txt" | head -12

OUT="$OUT/moe_ep" TEST_TIMEOUT=${EP_TEST_TIMEOUT:-120} NORMAL_TIMEOUT=${NORMAL_TIMEOUT:-70} bash bench/gpu/moe_ep.sh 2 \
  > "$OUT/moe_ep.txt" 2>&1
grep -E "passed|failed|graph diff|ratio|nvfp4|bf16" "$OUT/moe_ep.txt" | head -30
tar czf "$OUT/validate.tgz" -C "$OUT" attention moe moe_ep device.txt moe_ep.txt 2>/dev/null
exit 0
