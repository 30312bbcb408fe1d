#!/usr/bin/env bash
# A masked slab run as a block list (FRAG_SLAB_LIST, the layout's max_rows) against one program per slab block, on
# one H200: the fragment GEMMs' GPU tests, then the experts stage at EP1 / EP4 decode with few experts holding tokens.
# Usage (repo root, after `pip install -e .`): OUT=/tmp/out bash bench/gpu/slab_schedule.sh
set -u
OUT=${OUT:-/tmp/pdlab_slab_schedule}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/device.txt" 2>&1
echo "${PDLAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" > "$OUT/commit.txt"
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py 2>&1 \
    | tail -30 > "$OUT/tests_frag_gpu.txt"
cat "$OUT/tests_frag_gpu.txt"
DEF='{"FRAG_BM": 0}'
GRID='{"FRAG_BM": 0, "FRAG_SLAB_LIST": 0}'
for E in 256 64; do
  for SLAB in 0 256; do
    timeout "${BENCH_TIMEOUT:-150}" python3 bench/gpu/sparse_experts.py --experts $E --tokens ${TOKENS:-1,4,16} \
        --slab-rows $SLAB --unbounded --config "$DEF" --config "$GRID" --config '{}' 2>&1 \
        | tee -a "$OUT/sparse.jsonl" | tail -3
  done
done
exit 0
