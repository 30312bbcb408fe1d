#!/usr/bin/env bash
# MLA attention on one GPU: GPU tests, a small config sweep of the triton decode kernel at the goal
# shapes, then `bench attention` at the goal shapes with the defaults. Results go to $OUT
# (default /tmp/pdlab_attention). Run from the repository root.
set -u
OUT=${OUT:-/tmp/pdlab_attention}
mkdir -p "$OUT"
export PDLAB_RESULTS_DIR="$OUT"
PY=${PY:-python3}
STAGE=${STAGE:-all}   # all | tests | sweep | bench
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/device.txt" 2>&1
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date.txt"

if [[ $STAGE == all || $STAGE == tests ]]; then
  timeout 150 $PY -m pytest -q -m gpu tests/attention -x --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi

B="$PY -m pdlab.bench.cli attention --out $OUT --batch 128 --page-size 64 --s-q 1 --repeats 20 --max-seconds 1"
if [[ $STAGE == all || $STAGE == sweep ]]; then
  # memory-bound: 16 heads, bf16 and fp8
  H16=()
  for cfg in '{"BLOCK_H":16,"BLOCK_N":32,"num_stages":2,"num_warps":4}' \
             '{"BLOCK_H":16,"BLOCK_N":64,"num_stages":2,"num_warps":4}' \
             '{"BLOCK_H":16,"BLOCK_N":32,"num_stages":3,"num_warps":4}' \
             '{"BLOCK_H":16,"BLOCK_N":32,"num_stages":4,"num_warps":4}' \
             '{"BLOCK_H":16,"BLOCK_N":64,"num_stages":3,"num_warps":8}' \
             '{"BLOCK_H":16,"BLOCK_N":32,"num_stages":3,"num_warps":4,"num_splits":8}' \
             '{"BLOCK_H":16,"BLOCK_N":32,"num_stages":3,"num_warps":4,"waves":4}'; do H16+=(--config "$cfg"); done
  timeout 120 $B --backend triton --seqlen 8192 --heads 16 --kv-dtype bf16,fp8 --name sweep_h16 "${H16[@]}" 2>&1 | tail -30
  # compute-bound: 128 heads
  H128=()
  for cfg in '{"BLOCK_H":64,"BLOCK_N":32,"num_stages":2,"num_warps":8}' \
             '{"BLOCK_H":64,"BLOCK_N":16,"num_stages":3,"num_warps":8}' \
             '{"BLOCK_H":64,"BLOCK_N":64,"num_stages":2,"num_warps":8}' \
             '{"BLOCK_H":64,"BLOCK_N":32,"num_stages":3,"num_warps":8}' \
             '{"BLOCK_H":64,"BLOCK_N":32,"num_stages":2,"num_warps":4}' \
             '{"BLOCK_H":128,"BLOCK_N":32,"num_stages":2,"num_warps":8}' \
             '{"BLOCK_H":32,"BLOCK_N":32,"num_stages":3,"num_warps":4}'; do H128+=(--config "$cfg"); done
  timeout 150 $B --backend triton --seqlen 8192 --heads 128 --kv-dtype bf16 --name sweep_h128 "${H128[@]}" 2>&1 | tail -30
fi

if [[ $STAGE == all || $STAGE == bench ]]; then
  timeout 200 $B --backend triton,flashmla,flashinfer,torch --seqlen 1024,4096,8192,16384 --heads 16,128 \
    --kv-dtype bf16,fp8 --name mla_decode_goals 2>&1 | tail -50
fi
ls -la "$OUT"
