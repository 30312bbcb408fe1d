#!/usr/bin/env bash
# One batch of GPU validations on a 2-GPU H200 machine (kind nvidia-h200-x2), in two phases so that
# each fits one call. Every stage has its own time limit and is packed into one archive under $OUT
# as soon as it ends (the device machine returns only a handful of files).
#
#   PHASE=1 bash bench/gpu/final.sh   # kernels: quantize, attention, MoE experts on cuda:0 while
#                                     # the tuner produces the shipped configs on cuda:1   (~5 min)
#   PHASE=2 bash bench/gpu/final.sh   # runtime: engine perf + GPU tests, KV transfer, colocated vs
#                                     # disaggregated serving on two GPUs                  (~5.5 min)
set -u
OUT=${OUT:-/tmp/pdlab_final}
PHASE=${PHASE:-1}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PDLAB_CACHE_DIR=/tmp/pdlab_cache
unset TRITON_INTERPRET
PY=${PY:-python3}
LOG="$OUT/log_phase$PHASE.txt"
stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
pack() {  # stage dir → $OUT/<stage>.tgz
  tar czf "$OUT/$1.tgz" -C "$OUT" "$1" 2>/dev/null && rm -rf "${OUT:?}/$1"
}
BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))')
{
  date -u +%Y-%m-%dT%H:%M:%SZ; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} >> "$LOG" 2>&1

if [[ $PHASE == 1 ]]; then
  # cuda:1 — the tuner (shipped configs), alone on its GPU so its timings are not disturbed
  mkdir -p "$OUT/tuning"
  ( CUDA_VISIBLE_DEVICES=1 OUT="$OUT/tuning" TOTAL_BUDGET=${TUNE_BUDGET:-150} timeout 290 bash bench/gpu/tuning.sh \
      > "$OUT/tuning/tuning.txt" 2>&1; echo "tuning rc=$?" >> "$OUT/tuning/tuning.txt" ) &
  TUNER=$!

  export CUDA_VISIBLE_DEVICES=0
  stamp "quantize"; mkdir -p "$OUT/quantize"
  timeout 60 "${BENCH[@]}" quantize --measure-peaks --out "$OUT/quantize" > "$OUT/quantize/bench.txt" 2>&1
  stamp "bench quantize rc=$?"; grep -E "4096|16384|bit" "$OUT/quantize/bench.txt" | head -12 | tee -a "$LOG"
  timeout 40 $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels > "$OUT/quantize/pytest_gpu.txt" 2>&1
  stamp "pytest -m gpu tests/kernels rc=$?"; tail -2 "$OUT/quantize/pytest_gpu.txt" | tee -a "$LOG"
  pack quantize

  stamp "attention"; mkdir -p "$OUT/attention"
  A=(attention --out "$OUT/attention" --batch 128 --page-size 64 --s-q 1 --repeats 15 --max-seconds 0.5)
  timeout 40 "${BENCH[@]}" "${A[@]}" --backend triton,torch --seqlen 8192,16384 --heads 16 --kv-dtype bf16,fp8 \
    --config '{}' --config '{"fp8_compute": "fp16"}' --name goals_h16 > "$OUT/attention/goals_h16.txt" 2>&1
  stamp "attention h16 rc=$?"; grep -E "triton" "$OUT/attention/goals_h16.txt" | head -12 | tee -a "$LOG"
  timeout 40 "${BENCH[@]}" "${A[@]}" --backend triton,torch --seqlen 8192,16384 --heads 128 --kv-dtype bf16,fp8 \
    --config '{}' --config '{"fp8_compute": "fp16"}' --name goals_h128 > "$OUT/attention/goals_h128.txt" 2>&1
  stamp "attention h128 rc=$?"; grep -E "triton" "$OUT/attention/goals_h128.txt" | head -12 | tee -a "$LOG"
  timeout 40 $PY -m pytest -q -p no:cacheprovider -m gpu tests/attention > "$OUT/attention/pytest_gpu.txt" 2>&1
  stamp "pytest -m gpu tests/attention rc=$?"; tail -2 "$OUT/attention/pytest_gpu.txt" | tee -a "$LOG"
  pack attention

  stamp "moe experts"; mkdir -p "$OUT/moe_experts"
  timeout 80 $PY -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 \
    --out "$OUT/moe_experts/decode" > "$OUT/moe_experts/decode.txt" 2>&1
  stamp "moe decode rc=$?"; grep -v "━" "$OUT/moe_experts/decode.txt" | tail -30 | tee -a "$LOG"
  timeout 45 $PY -m pdlab.bench.moe_experts --shapes prefill --layouts contiguous --payloads bf16 \
    --prefill-tokens 512,2048 --out "$OUT/moe_experts/prefill" > "$OUT/moe_experts/prefill.txt" 2>&1
  stamp "moe prefill rc=$?"; grep -v "━" "$OUT/moe_experts/prefill.txt" | tail -12 | tee -a "$LOG"
  pack moe_experts

  wait $TUNER
  stamp "tuning done"; tail -12 "$OUT/tuning/tuning.txt" | tee -a "$LOG"
  pack tuning
fi

if [[ $PHASE == 2 ]]; then
  MODEL=${MODEL:-synthetic:deepseek-r1:4}
  # cuda:0 — engine perf (decode throughput per batch size, host share, TTFT); cuda:1 — GPU tests
  mkdir -p "$OUT/runtime" "$OUT/disagg"
  ( CUDA_VISIBLE_DEVICES=1 timeout 110 $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" \
      tests/runtime tests/disagg tests/moe/test_dispatch.py -rA > "$OUT/runtime/pytest_gpu.txt" 2>&1; echo "rc=$?" >> "$OUT/runtime/pytest_gpu.txt" ) &
  TESTS=$!
  stamp "runtime perf"
  CUDA_VISIBLE_DEVICES=0 PDLAB_STEP_PROFILE=1 timeout 120 $PY -m pdlab.runtime.engine.perf --model-path "$MODEL" \
    --device cuda --batch-sizes 1,8,32,64,128,256 --context 1024 --steps 10 --ttft-lens 1024,8192 \
    --out "$OUT/runtime/perf" > "$OUT/runtime/perf.txt" 2>&1
  stamp "runtime perf rc=$?"; tail -14 "$OUT/runtime/perf.txt" | tee -a "$LOG"
  wait $TESTS
  stamp "runtime/disagg gpu tests"; tail -4 "$OUT/runtime/pytest_gpu.txt" | tee -a "$LOG"
  timeout 60 $PY -m pytest -q -p no:cacheprovider -m multigpu tests/disagg -rA > "$OUT/disagg/pytest_multigpu.txt" 2>&1
  stamp "disagg multigpu tests rc=$?"; tail -2 "$OUT/disagg/pytest_multigpu.txt" | tee -a "$LOG"
  pack runtime

  # KV transfer of an 8k-token prompt (61 layers) cuda:0 → cuda:1, colocated vs disaggregated serving
  OUT="$OUT/disagg" STAGES="transfer colocated disagg" NUM_PROMPTS=${NUM_PROMPTS:-32} MODEL="$MODEL" \
    timeout 330 bash bench/gpu/disagg.sh > "$OUT/disagg/disagg.txt" 2>&1
  stamp "disagg rc=$?"; grep -E "GB/s|rc=|equal|TTFT|TPOT|goodput|throughput" "$OUT/disagg/disagg.txt" | head -40 | tee -a "$LOG"
  pack disagg
fi
stamp "phase $PHASE done"
