#!/usr/bin/env bash
# The attention and runtime GPU tests on one GPU, first without flashinfer, then with it importable (the shipped
# store then sends its bf16 buckets to flashinfer in eager calls; graphs and fp8 pools stay on pdlab's kernels).
set -u
OUT=${OUT:-/tmp/pdlab_flashinfer_validate}
PY=${PY:-python3}
mkdir -p "$OUT"
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
T=(tests/attention/test_gpu.py tests/runtime)
timeout ${TWITHOUT:-230} $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" "${T[@]}" \
  > "$OUT/without_flashinfer.txt" 2>&1
echo "without flashinfer rc=$?"; tail -3 "$OUT/without_flashinfer.txt"
. "$(dirname "$0")/flashinfer_env.sh"
timeout ${TWITH:-250} $PY -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" "${T[@]}" \
  tests/attention/test_flashinfer_gpu.py > "$OUT/with_flashinfer.txt" 2>&1
echo "with flashinfer rc=$?"; tail -3 "$OUT/with_flashinfer.txt"
