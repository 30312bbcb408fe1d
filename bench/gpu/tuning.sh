#!/usr/bin/env bash
# Produce the shipped tuned configs on one GPU (an H200): mla_decode (bf16 and fp8 cache, 16 and 128
# heads, batch buckets, seqlen 4096) and the Triton NVFP4 experts (DeepSeek-R1 EP1 and EP4 shapes,
# tokens-per-expert buckets, nvfp4 activations, contiguous layout).
#
#   OUT=/tmp/pdlab_tuning TOTAL_BUDGET=180 bash bench/gpu/tuning.sh
#
# TOTAL_BUDGET (seconds of tuning, default 180, so that install + weight building + tuning fit a
# 5-minute call) is split 45 % attention / 55 % experts; a run may overrun it by one trial and the
# re-measurement per study. PARALLEL=1 (two GPUs): attention on cuda:0 and experts on cuda:1 at
# the same time, each with the whole TOTAL_BUDGET and its own optuna storage file. ATT_BATCH / MOE_TPE pick the buckets; RUN_TESTS=1 also runs tests/tuning.
# Writes under $OUT: configs/<device_key>/{mla_decode,moe_experts}.json (copy them into tuning/configs/), tuning_{att,moe}.db (the optuna studies; rerun with the same files to
# resume), per-op summary CSV/JSON and PNG plots, summary.txt (geometric-mean speedup per op and the
# time each op's tuning took), device/commit/date, served_check.txt (the GPU runtime and attention tests run
# with the new configs: copy them into tuning/configs only when it passed).
set -u
OUT=${OUT:-/tmp/pdlab_tuning}
TOTAL_BUDGET=${TOTAL_BUDGET:-180}
RUN_TESTS=${RUN_TESTS:-0}
ATT_BATCH=${ATT_BATCH:-1,32,128}        # mla_decode batch buckets (seqlen 4096, heads 16/128, bf16/fp8)
ATT_SEQLEN=${ATT_SEQLEN:-4096}         # mla_decode seqlen buckets
ATT_HEADS=${ATT_HEADS:-16,128}         # mla_decode heads and cache dtype buckets
ATT_KV=${ATT_KV:-bf16,fp8}
ATT_BACKENDS=${ATT_BACKENDS:-triton}   # mla_decode backends searched (e.g. triton,flashinfer: the winner per bucket)
MOE_TPE=${MOE_TPE:-4,64,256,1024}       # tokens-per-expert buckets (nvfp4, contiguous)
MOE_EXPERTS=${MOE_EXPERTS:-256,64}      # local experts: EP1 and EP4 of DeepSeek-R1
MOE_ACTIVE=${MOE_ACTIVE:-}              # experts holding tokens (e.g. 8,32,128: the sparse decode buckets); all if empty
MERGE_SHIPPED=${MERGE_SHIPPED:-0}       # 1: start $OUT/configs from the shipped files, so the new entries merge into them
PY=${PY:-python3}
mkdir -p "$OUT"
if [[ $MERGE_SHIPPED == 1 ]]; then
  KEY=$($PY -c "from pdlab.kernels.arch import device_facts; print(device_facts('cuda').key)")
  mkdir -p "$OUT/configs/$KEY" && cp tuning/configs/$KEY/*.json "$OUT/configs/$KEY/"
fi
export PDLAB_CONFIG_DIR="$OUT/configs" PDLAB_CACHE_DIR="$OUT/cache" PDLAB_RESULTS_DIR="$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"

if [[ $RUN_TESTS == 1 ]]; then
  timeout 120 $PY -m pytest -q tests/tuning -x 2>&1 | tail -5 | tee "$OUT/cpu_tests.txt"
fi

PARALLEL=${PARALLEL:-0}
ONLY=${ONLY:-}                          # att | moe: tune one op only, with the whole budget, on the visible GPU
MOE_LAYOUT=${MOE_LAYOUT:-contiguous}    # moe buckets' dispatch layout(s) and activation payload(s)
MOE_PAYLOAD=${MOE_PAYLOAD:-nvfp4}
if [[ $PARALLEL == 1 || -n $ONLY ]]; then
  ATT=$TOTAL_BUDGET; MOE=$TOTAL_BUDGET
else
  ATT=$(( TOTAL_BUDGET * 45 / 100 )); MOE=$(( TOTAL_BUDGET - ATT ))
fi
COMMON="--repeats 10 --warmup 2 --no-progress"

# run `tune` within a budget; exit code 3 = a config broke the CUDA context: rerun, which resumes
# the studies (that trial stays failed), with what is left of the budget
tune_resuming() {  # LOG BUDGET_S ARGS...
  local log=$1 budget=$2; shift 2
  local t0 rc=3 tries=0 left
  t0=$(date +%s)
  while [[ $rc == 3 && $tries -lt 3 ]]; do
    left=$(( budget - $(date +%s) + t0 ))
    (( left < 10 )) && break
    timeout $(( left + 90 )) $PY -m pdlab tune "$@" --budget ${left}s $COMMON 2>&1 | tee -a "$log" | tail -30
    rc=${PIPESTATUS[0]}
    tries=$(( tries + 1 ))
  done
}

tune_attention() {
  tune_resuming "$OUT/attention.log" $ATT attention --op mla_decode --backends $ATT_BACKENDS --storage "$OUT/tuning_att.db" \
    --only batch=$ATT_BATCH --only seqlen=$ATT_SEQLEN --only heads=$ATT_HEADS --only kv_dtype=$ATT_KV --out "$OUT/attention"
}
tune_experts() {
  tune_resuming "$OUT/moe.log" $MOE moe --backends triton --storage "$OUT/tuning_moe.db" \
    --only experts=$MOE_EXPERTS --only tokens_per_expert=$MOE_TPE --only layout=$MOE_LAYOUT --only payload=$MOE_PAYLOAD \
    ${MOE_ACTIVE:+--only active_experts=$MOE_ACTIVE} --out "$OUT/moe"
}
START=$(date +%s)
# mla_decode: ATT_BATCH x ATT_SEQLEN x ATT_HEADS x ATT_KV; Triton NVFP4 experts: EP1 (256
# local experts) and EP4 (64) x MOE_TPE
if [[ $ONLY == att ]]; then
  tune_attention > /dev/null; MID=$(date +%s)
elif [[ $ONLY == moe ]]; then
  MID=$START; tune_experts > /dev/null
elif [[ $PARALLEL == 1 ]]; then
  ( export CUDA_VISIBLE_DEVICES=0; tune_attention > /dev/null ) &
  ( export CUDA_VISIBLE_DEVICES=1; tune_experts > /dev/null ) &
  wait
  MID=$START
else
  tune_attention
  MID=$(date +%s)
  tune_experts
fi
END=$(date +%s)

# served check: the new configs (PDLAB_CONFIG_DIR is $OUT/configs) in what a server does with them — the GPU
# runtime tests (CUDA-graph decode, retraction with an fp8 pool) and the attention GPU tests. Copy the
# configs into tuning/configs only when this passes (SERVED_CHECK=0 skips it).
if [[ ${SERVED_CHECK:-1} == 1 ]]; then
  timeout 240 $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime/test_engine_gpu.py \
    tests/attention/test_gpu.py > "$OUT/served_check.txt" 2>&1
  echo "rc=$?" >> "$OUT/served_check.txt"
fi

{
  echo "device: $(tail -1 "$OUT/device.txt")   commit: $(cat "$OUT/commit.txt" 2>/dev/null)   date: $(cat "$OUT/date.txt")"
  grep -h "geometric-mean speedup\|nothing stored\|WARNING" "$OUT/attention.log" "$OUT/moe.log" 2>/dev/null
  $PY -m pdlab tune show --geomean 2>&1
  [[ -f "$OUT/served_check.txt" ]] && echo "served check (runtime + attention GPU tests with these configs): \
$(grep -E "passed|failed" "$OUT/served_check.txt" | tail -1) $(tail -1 "$OUT/served_check.txt")"
  if [[ $PARALLEL == 1 ]]; then
    echo "wall time: attention and experts in parallel on two GPUs, total $(( END - START )) s (budget $TOTAL_BUDGET s each)"
  else
    echo "wall time: attention $(( MID - START )) s, experts $(( END - MID )) s, total $(( END - START )) s (budget $TOTAL_BUDGET s)"
  fi
} | tee "$OUT/summary.txt"
ls -R "$OUT/configs" 2>/dev/null | head -20
