#!/usr/bin/env bash
# Tune mla_prefill on one GPU (DeepSeek-R1 shapes: batch 1/8 × q_len 256/2048 × prefix 0/4096 × heads 16/128,
# bf16 cache, page 64), then time the tuned store against the defaults with `bench attention --op prefill`.
#
#   OUT=/tmp/pdlab_prefill BUDGET=400 bash bench/gpu/tune_prefill.sh
#
# BUDGET: seconds of tuning (the op's budget, shared evenly over the buckets). BACKENDS: searched backends (default
# triton; add flashinfer to let the winner per bucket be either). HEADS: the heads buckets. Writes under $OUT:
# configs/<device_key>/mla_prefill.json (copy it into tuning/configs/ to ship it), tuning.db (the optuna studies;
# rerun with the same file to resume), tuning/ (per-trial CSV/JSON, plots), tune.log, summary.txt (the geometric-mean
# speedup, the wall time), bench/ (default vs tuned rows at the buckets' shapes, CSV) and device/commit/date.
set -u
OUT=${OUT:-/tmp/pdlab_prefill}
BUDGET=${BUDGET:-400}
BACKENDS=${BACKENDS:-triton}
HEADS=${HEADS:-16,128}
PY=${PY:-python3}
mkdir -p "$OUT"
export PDLAB_CONFIG_DIR="$OUT/configs" PDLAB_CACHE_DIR="$OUT/cache" PDLAB_RESULTS_DIR="$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"

START=$(date +%s)
timeout $(( BUDGET + 120 )) $PY -m pdlab tune attention --op mla_prefill --backends "$BACKENDS" --only heads="$HEADS" \
  --storage "$OUT/tuning.db" --store "$OUT/configs" --out "$OUT/tuning" --budget "${BUDGET}s" \
  --repeats 10 --warmup 2 --no-progress > "$OUT/tune.log" 2>&1
echo "tune exit $?" >> "$OUT/tune.log"
END=$(date +%s)
tail -40 "$OUT/tune.log"

# the stored configs against the defaults, through the public op (nearest-bucket lookup), at the buckets' shapes
for nt in 256 2048; do
  timeout 150 $PY -m pdlab bench attention --op prefill --backend triton --batch 1,8 --new-tokens $nt \
    --seqlen $nt,$(( nt + 4096 )) --heads "$HEADS" --kv-dtype bf16 --config default --config tuned --repeats 10 \
    --max-seconds 3 --out "$OUT/bench" --name prefill_new$nt 2>&1 | tail -25
done

{
  echo "device: $(tail -1 "$OUT/device.txt")   commit: $(cat "$OUT/commit.txt")   date: $(cat "$OUT/date.txt")"
  grep -h "geometric-mean speedup\|nothing stored\|WARNING" "$OUT/tune.log"
  $PY -m pdlab tune show --geomean 2>&1
  echo "wall time: tuning $(( END - START )) s (budget $BUDGET s)"
} | tee "$OUT/summary.txt"
