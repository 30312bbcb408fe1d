set -u
unset TRITON_INTERPRET
mkdir -p $OUT/v
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/v/device.txt 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py tests/moe/test_runners.py tests/moe/test_layer.py tests/moe/test_triton_nvfp4_fast.py -rfE > $OUT/v/pytest_moe_gpu.txt 2>&1
echo "rc=$?" >> $OUT/v/pytest_moe_gpu.txt; tail -2 $OUT/v/pytest_moe_gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime -rfE > $OUT/v/pytest_runtime_gpu.txt 2>&1
echo "rc=$?" >> $OUT/v/pytest_runtime_gpu.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_stored_experts.py -rfE >> $OUT/v/pytest_runtime_gpu.txt 2>&1
echo "rc=$?" >> $OUT/v/pytest_runtime_gpu.txt; tail -6 $OUT/v/pytest_runtime_gpu.txt
