set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 330 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/moe > $R/pytest_moe_gpu.txt 2>&1; echo rc=$? >> $R/pytest_moe_gpu.txt; tail -2 $R/pytest_moe_gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime/test_engine_gpu.py > $R/pytest_runtime_gpu.txt 2>&1; echo rc=$? >> $R/pytest_runtime_gpu.txt; tail -2 $R/pytest_runtime_gpu.txt
tar czf $OUT/r29.tgz -C $R .
