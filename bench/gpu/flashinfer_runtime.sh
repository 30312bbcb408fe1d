#!/usr/bin/env bash
# What flashinfer changes in the runtime on one GPU: the synthetic DeepSeek-R1-shaped model (full width, 4 layers),
# eager decode at batch 64 over an 8k context and TTFT at 1k / 8k prompt tokens, first without flashinfer (pdlab's
# kernels), then with it importable (prefill prefers it; eager decode takes it where the shipped store's bucket
# chose it). CUDA-graph decode is the same in both: the replayed graphs never take flashinfer. Results: $OUT.
set -u
OUT=${OUT:-/tmp/pdlab_flashinfer_runtime}
mkdir -p "$OUT"
PY=${PY:-python3}
MODEL=${MODEL:-synthetic:deepseek-r1:4}
. "$(dirname "$0")/provenance.sh"
record_provenance "$OUT"
perf() {  # NAME
  timeout ${TPERF:-240} $PY -m pdlab.runtime.engine.perf --model-path "$MODEL" --device cuda --batch-sizes 64 \
    --context 8192 --steps 10 --ttft-lens 1024,8192 --disable-cuda-graph --out "$OUT/$1" > "$OUT/$1.txt" 2>&1
  echo "$1 rc=$?"; tail -8 "$OUT/$1.txt"
}
perf without_flashinfer
. "$(dirname "$0")/flashinfer_env.sh"
$PY -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' | tee "$OUT/with_flashinfer_version.txt"
perf with_flashinfer
