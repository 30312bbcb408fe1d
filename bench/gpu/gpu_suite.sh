#!/usr/bin/env bash
# Every GPU-marked test of the repository on one GPU, in three groups run side by side (separate processes; the
# tests assert results, not times): attention + kernels, moe, and runtime + disagg + tuning + bench + the package
# test. flashinfer is on the path where FI_TAR (bench/gpu/flashinfer_env.sh) exists, so its tests run too.
# Results in $OUT: one pytest log and one JUnit XML per group, summary.txt (the last line of each log and its exit
# code), device.txt, and all of it packed beside $OUT as $OUT.tgz (one file to fetch where a transfer limits how many
# come back). GROUP_TIMEOUT (s, default 480) bounds each group. Run from the repository root after
# `pip install -e .`.
set -u
OUT=${OUT:-/tmp/pdlab_gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
PY=${PY:-python3}
T=${GROUP_TIMEOUT:-480}
if [[ -f ${FI_TAR:-.whl/flashinfer_trim.tar.xz} ]]; then
  . "$(dirname "${BASH_SOURCE[0]}")/flashinfer_env.sh"
fi
{ date -u +%Y-%m-%dT%H:%M:%SZ; [[ -n ${PDLAB_COMMIT:-} ]] && echo "$PDLAB_COMMIT" || git rev-parse --short HEAD
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1; } > "$OUT/device.txt" 2>&1

run_group() {  # name, test paths...
  local name=$1; shift
  timeout "$T" $PY -m pytest -q -rs -p no:cacheprovider -m gpu --durations=15 --junitxml="$OUT/$name.xml" "$@" \
    > "$OUT/$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/$name.txt"
}
run_group attention_kernels tests/attention tests/kernels &
run_group moe tests/moe &
run_group runtime_rest tests/runtime tests/disagg tests/tuning tests/bench tests/test_package.py &
wait
for f in attention_kernels moe runtime_rest; do
  echo "$f: $(grep -E '(passed|failed|error)' "$OUT/$f.txt" | tail -1) $(tail -1 "$OUT/$f.txt")"
done > "$OUT/summary.txt"
cat "$OUT/summary.txt"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
