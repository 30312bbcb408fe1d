#!/usr/bin/env bash
# Produce the shipped tuned configs on one GPU (an H200): mla_decode (bf16 and fp8 cache, 16 and 128
# heads, batch buckets, seqlen 4096) and the Triton NVFP4 experts (DeepSeek-R1 EP1 and EP4 shapes,
# tokens-per-expert buckets, nvfp4 activations, contiguous layout).
#
#   OUT=/tmp/pdlab_tuning TOTAL_BUDGET=210 bash bench/gpu/tuning.sh
#
# TOTAL_BUDGET (seconds, default 210, so that setup + tests + tuning fit a 5-minute call) is split
# 45 % attention / 55 % experts. Writes under $OUT: configs/<device_key>/{mla_decode,moe_experts}.json
# (copy them into tuning/configs/), tuning.db (the optuna studies; rerun with the same file to
# resume), per-op summary CSV/JSON and PNG plots, summary.txt (geometric-mean speedup per op and the
# time each op's tuning took), device/commit/date.
set -u
OUT=${OUT:-/tmp/pdlab_tuning}
TOTAL_BUDGET=${TOTAL_BUDGET:-210}
PY=${PY:-python3}
mkdir -p "$OUT"
export PDLAB_CONFIG_DIR="$OUT/configs" PDLAB_CACHE_DIR="$OUT/cache" PDLAB_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/device.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date.txt"

timeout 90 $PY -m pytest -q tests/tuning -x 2>&1 | tail -5 | tee "$OUT/cpu_tests.txt"

ATT=$(( TOTAL_BUDGET * 45 / 100 ))
MOE=$(( TOTAL_BUDGET - ATT ))
T="$PY -m pdlab tune"
COMMON="--storage $OUT/tuning.db --repeats 10 --no-progress"
START=$(date +%s)

# mla_decode: 3 batch buckets x {16, 128} heads x {bf16, fp8} at seqlen 4096 = 12 buckets
timeout $(( ATT + 60 )) $T attention --op mla_decode --backends triton --budget ${ATT}s $COMMON \
  --only batch=1,32,128 --only seqlen=4096 --only heads=16,128 --only kv_dtype=bf16,fp8 \
  --out "$OUT/attention" 2>&1 | tee "$OUT/attention.log" | tail -30
MID=$(date +%s)

# Triton NVFP4 experts: EP1 (256 local experts) and EP4 (64), 4 tokens-per-expert buckets = 8 buckets
timeout $(( MOE + 90 )) $T moe --backends triton --budget ${MOE}s $COMMON \
  --only experts=256,64 --only tokens_per_expert=4,64,256,1024 --only layout=contiguous --only payload=nvfp4 \
  --out "$OUT/moe" 2>&1 | tee "$OUT/moe.log" | tail -30
END=$(date +%s)

{
  echo "device: $(tail -1 "$OUT/device.txt")   commit: $(cat "$OUT/commit.txt" 2>/dev/null)   date: $(cat "$OUT/date.txt")"
  grep -h "geometric-mean speedup\|nothing stored" "$OUT/attention.log" "$OUT/moe.log"
  echo "wall time: attention $(( MID - START )) s, experts $(( END - MID )) s, total $(( END - START )) s (budget $TOTAL_BUDGET s)"
} | tee "$OUT/summary.txt"
ls -R "$OUT/configs" 2>/dev/null | head -20
