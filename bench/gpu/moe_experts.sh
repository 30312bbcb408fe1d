#!/usr/bin/env bash
# GPU validation and benchmark of the MoE expert runners (routing + moe_experts) on one H200.
# Usage (repo root, after `pip install -e .`): OUT=/tmp/out bash bench/gpu/moe_experts.sh
# Needs ~8 minutes with the defaults (tests 150 s, decode sweep 200 s, prefill 120 s); the stage limits
# are env vars (TEST_TIMEOUT, DECODE_TIMEOUT, PREFILL_TIMEOUT), SWEEP= (empty) skips the config sweeps.
# GPU_TEST_FILES, DECODE_LAYOUTS, SWEEP_TOKENS narrow the run.
# Writes: $OUT/device.txt, $OUT/tests_*.txt, $OUT/decode/moe_experts*.{csv,json,png}, $OUT/prefill/...
set -u
OUT=${OUT:-/tmp/pdlab_moe_experts}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/device.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date.txt"

# GPU_TESTS_K narrows the GPU tests (e.g. "split or configs") when the device time is short
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    ${GPU_TEST_FILES:-tests/moe/test_runners.py tests/moe/test_triton_nvfp4_fast.py} \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tail -40 > "$OUT/tests_gpu.txt"
if [ -z "${SKIP_ROUTING:-}" ]; then
  timeout 40 python3 -m pytest -q -p no:cacheprovider tests/moe/test_routing.py 2>&1 | tail -15 > "$OUT/tests_routing_on_gpu.txt"
fi
cat "$OUT"/tests_*.txt

timeout "${DECODE_TIMEOUT:-200}" python3 -m pdlab.bench.moe_experts --shapes decode \
    --decode-tokens "${DECODE_TOKENS:-1,4,16,64}" --layouts "${DECODE_LAYOUTS:-masked,contiguous}" \
    --sweep-tokens "${SWEEP_TOKENS:-1,16,64,512,2048}" ${SWEEP---sweep} --out "$OUT/decode" 2>&1 | grep -v "━" | tail -80
timeout "${PREFILL_TIMEOUT:-120}" python3 -m pdlab.bench.moe_experts --shapes prefill --layouts contiguous \
    --payloads bf16 --prefill-tokens "${PREFILL_TOKENS:-512,2048}" --sweep-tokens "${SWEEP_TOKENS:-1,16,64,512,2048}" \
    ${SWEEP---sweep} --out "$OUT/prefill" 2>&1 \
    | grep -v "━" | tail -40
exit 0
