#!/usr/bin/env bash
# Prefill CUDA graphs on one GPU, ~2 minutes: the GPU tests of graph decode and prefill graphs (greedy tokens,
# logits and KV rows against eager prefill, the sync-free local dispatch), then prefill step times of one prompt
# with graphs up to 256 tokens (--prefill-graph-tokens 256, the runtime's default) and without (0): the tiny model,
# then DeepSeek-R1 widths with 4 layers. Results in $OUT (default /tmp/pdlab_prefill_graphs): tests.txt,
# <model>_<tokens>/. Run from the repository root after `pip install -e .`.
set -u
OUT=${OUT:-/tmp/pdlab_prefill_graphs}
PY=${PY:-python3}
mkdir -p "$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
timeout 170 $PY -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime/test_engine_gpu.py \
  tests/moe/test_dispatch.py -k "prefill_graphs or cuda_graph_decode or failed_graph_capture or never_sync" \
  > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
for model in tiny synthetic:deepseek-r1:4; do
  MP=(); [[ $model != tiny ]] && MP=(--model-path "$model")
  for n in 256 0; do
    d=$OUT/${model//[:]/_}_$n
    timeout 100 $PY "$(dirname "$0")/prefill_profile.py" "${MP[@]}" --prefill-graph-tokens $n \
      --tokens 16,64,128,256,512 --reps 20 --profile-tokens 0 --out "$d" > "$d.log" 2>&1
    echo "== $model, prefill graphs up to $n tokens"
    grep -E "prefill cuda graphs|prefill .*tokens:" "$d/prefill_profile.txt"
  done
done
