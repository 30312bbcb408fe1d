set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime > $R/pytest_runtime_gpu.txt 2>&1; echo rc=$? >> $R/pytest_runtime_gpu.txt; tail -1 $R/pytest_runtime_gpu.txt
timeout 150 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1; echo rc=$? >> $R/bench_moe.txt; tail -1 $R/bench_moe.txt
tar czf $OUT/r37.tgz -C $R .
