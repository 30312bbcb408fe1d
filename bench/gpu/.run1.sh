set -u
mkdir -p $OUT/t
unset TRITON_INTERPRET
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/t/device.txt 2>&1
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py tests/moe/test_triton_nvfp4_fast.py tests/moe/test_layer.py -x -rfE > $OUT/t/pytest_moe_gpu.txt 2>&1
echo "rc=$?" >> $OUT/t/pytest_moe_gpu.txt
tail -5 $OUT/t/pytest_moe_gpu.txt
timeout 230 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime -rfE > $OUT/t/pytest_runtime_gpu.txt 2>&1
echo "rc=$?" >> $OUT/t/pytest_runtime_gpu.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_stored_experts.py -rfE >> $OUT/t/pytest_runtime_gpu.txt 2>&1
echo "rc=$?" >> $OUT/t/pytest_runtime_gpu.txt
tail -8 $OUT/t/pytest_runtime_gpu.txt
