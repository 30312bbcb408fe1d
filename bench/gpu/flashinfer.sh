#!/usr/bin/env bash
# flashinfer's MLA kernels (BatchMLAPagedAttentionWrapper, fa3 on sm90) against pdlab's on one GPU, in one batch:
# install flashinfer from files brought along (the GPU machines reach no package index), JIT-compile it, run its GPU
# tests against the torch fp32 reference, then `bench attention` decode (eager and CUDA graph) and prefill with
# triton and flashinfer side by side. Results go to $OUT as one archive. Run from the repository root.
# The flashinfer files: see flashinfer_env.sh.
set -u
OUT=${OUT:-/tmp/pdlab_flashinfer}
PY=${PY:-python3}
. "$(dirname "$0")/flashinfer_env.sh"
{ echo "CUDA_HOME=${CUDA_HOME:-unset}"; nvcc --version 2>&1 | tail -2
  $PY -c 'import flashinfer, tvm_ffi, torch; print("flashinfer", flashinfer.__version__, "torch", torch.__version__)'
} 2>&1 | tee "$OUT/env.txt"

# the JIT build, timed, on one small decode call (bf16, 16 heads) and one prefill call
timeout ${TJIT:-420} $PY - <<'PYEOF' 2>&1 | tail -25 | tee "$OUT/jit.txt"
import time, torch
from pdlab.attention import mla_decode, mla_prefill
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.bench.harness import cosine_error
t0 = time.time()
p = decode_problem([100, 2000], 16, 1, 64, torch.bfloat16, device="cuda", seed=0)
args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
out, lse = mla_decode(*args, backend="flashinfer"); torch.cuda.synchronize()
ref = mla_decode(*args, backend="torch")
print(f"decode JIT + first call {time.time() - t0:.1f} s, cosine error out {cosine_error(out, ref[0]):.2e} "
      f"lse {cosine_error(lse, ref[1]):.2e}")
t0 = time.time()
p = prefill_problem([300, 64], [100, 64], 16, 64, torch.bfloat16, device="cuda", seed=0)
a = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
out, lse = mla_prefill(*a, backend="flashinfer"); torch.cuda.synchronize()
ref = mla_prefill(*a, backend="torch")
print(f"prefill first call {time.time() - t0:.1f} s, cosine error out {cosine_error(out, ref[0]):.2e} "
      f"lse {cosine_error(lse, ref[1]):.2e}")
PYEOF

timeout ${TTEST:-150} $PY -m pytest -q -m gpu tests/attention/test_flashinfer_gpu.py tests/attention/test_adapters.py -rA \
  > "$OUT/gpu_tests.txt" 2>&1
tail -12 "$OUT/gpu_tests.txt"

BENCH=($PY -c 'import sys; from pdlab.bench.cli import main; sys.exit(main(sys.argv[1:]))' attention --out "$OUT")
# decode: 16 heads (memory-bound) and 128 heads (compute-bound), bf16 cache (flashinfer's MLA kernels take no fp8
# cache), page 64, S_q 1; pdlab's rows run the tuned store (the default of `bench attention`)
for mode in graph eager; do
  G=(); [[ $mode == graph ]] && G=(--cuda-graph)
  timeout ${TDEC:-150} "${BENCH[@]}" --backend triton,flashinfer --batch 1,8,32,128 --seqlen 1024,4096,16384 \
    --heads 16,128 --kv-dtype bf16 --page-size 64 --s-q 1 --repeats 20 --max-seconds 0.4 "${G[@]}" \
    --name decode_$mode > "$OUT/decode_$mode.txt" 2>&1
  tail -30 "$OUT/decode_$mode.txt"
done
timeout ${TPRE:-60} "${BENCH[@]}" --op prefill --backend triton,flashinfer --batch 2,8 --seqlen 4096 --heads 16,128 \
  --kv-dtype bf16 --page-size 64 --repeats 5 --max-seconds 0.5 --name prefill > "$OUT/prefill.txt" 2>&1
tail -10 "$OUT/prefill.txt"
tar czf /tmp/flashinfer_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/flashinfer_results.tgz "$OUT/"
ls "$OUT"
