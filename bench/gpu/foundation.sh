#!/usr/bin/env bash
# Foundation GPU validation: the NVFP4 Triton kernel bit-exact vs the torch reference (pytest -m gpu)
# and `bench quantize` with measured HBM bandwidth. Writes at most 6 files to $OUT.
# Run from the repository root on a CUDA machine (2 GPUs: tests on the second, bench on the first).
set -uo pipefail
OUT=${OUT:-out/foundation}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PDLAB_CACHE_DIR=${PDLAB_CACHE_DIR:-/tmp/pdlab_cache}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
TEST_GPU=$(( NGPU > 1 ? 1 : 0 ))

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1

# tests on one GPU while the benchmark runs alone on the other
CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 170 python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider \
  > "$OUT/pytest_gpu.txt" 2>&1 &
TEST_PID=$!
TEST_RC=0
if [ "$NGPU" -le 1 ]; then wait $TEST_PID; TEST_RC=$?; fi

CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pdlab bench quantize --measure-peaks --sweep --out "$OUT" \
  > "$OUT/bench_quantize.txt" 2>&1
BENCH_RC=$?
if [ "$NGPU" -gt 1 ]; then wait $TEST_PID; TEST_RC=$?; fi
{
  CUDA_VISIBLE_DEVICES=0 python3 -m pdlab bench contracts --calls 20000
  CUDA_VISIBLE_DEVICES=0 python3 -m pdlab bench list
} >> "$OUT/device.txt" 2>&1
echo "pytest -m gpu rc=$TEST_RC; bench quantize rc=$BENCH_RC" | tee -a "$OUT/device.txt"
tail -5 "$OUT/pytest_gpu.txt"
cat "$OUT/bench_quantize.txt" | tail -60
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
