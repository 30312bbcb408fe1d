#!/usr/bin/env bash
# Expert-parallel MoE on N GPUs of one host: the EP multi-GPU tests (EP layer == single-GPU layer,
# both modes) and `bench moe --ep N` with the NCCL dispatcher — normal mode at 4096 tokens/rank and
# low-latency mode at 128 tokens/rank, payloads bf16/fp8/nvfp4 — recording the nvfp4 (and fp8) vs
# bf16 dispatch+combine time ratios, plus a torch.profiler table of dispatch/combine per configuration.
# Usage (repo root, after `pip install -e .`): OUT=/tmp/out bash bench/gpu/moe_ep.sh [EP]
#   EP defaults to the number of GPUs (2, 4 or 8 run unchanged). DISPATCHER=deepep to use DeepEP.
# Writes few files (the device transfer returns a limited number): $OUT/tests_ep.txt, bench_{normal,ll}.txt,
# device.txt, and moe_ep<N>_results.tgz holding every CSV/JSON/PNG/profile under res/.
# Scaling 2 -> 4 -> 8 GPUs (issue: EP8): run this script on each machine size, unpack the tarballs, then
#   python3 -m pdlab.bench.moe --scaling ep2/res/*.csv ep4/res/*.csv ep8/res/*.csv --out DIR
set -u
OUT=${OUT:-/tmp/pdlab_moe_ep}
RES="$OUT/res"
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
EP=${1:-${EP:-$NGPU}}
DISPATCHER=${DISPATCHER:-nccl}
{ echo "EP=$EP dispatcher=$DISPATCHER gpus=$NGPU date=$(date -u +%Y-%m-%dT%H:%M:%SZ) commit=$(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/device.txt" 2>&1
head -1 "$OUT/device.txt"

PDLAB_EP=$EP timeout "${TEST_TIMEOUT:-110}" python3 -m pytest -q -s -p no:cacheprovider -m "gpu or multigpu" \
    tests/moe/test_ep.py tests/moe/test_dispatch_reduce.py tests/moe/test_dispatch.py tests/moe/test_dispatch_tuned.py \
    2>&1 | tail -60 > "$OUT/tests_ep.txt"
cat "$OUT/tests_ep.txt"

bench() {  # bench <name> <timeout> <args...>
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m pdlab.bench.moe --ep "$EP" --dispatcher "$DISPATCHER" --dispatch bf16,fp8,nvfp4 \
        --repeats "${REPEATS:-10}" ${PROFILE---profile} --out "$RES" --name "moe_ep${EP}_$name" "$@" 2>&1 \
        | grep -v "━" | tail -60 | tee "$OUT/bench_$name.txt"
}
bench normal "${NORMAL_TIMEOUT:-80}" --mode normal --tokens "${NORMAL_TOKENS:-4096}"
bench ll "${LL_TIMEOUT:-60}" --mode low_latency --tokens "${LL_TOKENS:-128}"
tar -czf "$OUT/moe_ep${EP}_results.tgz" -C "$OUT" res && rm -rf "$RES"
exit 0
