set -u
R=$TMPDIR/r47; mkdir -p $R
trap 'tar czf $OUT/r47.tgz -C $R . 2>/dev/null' EXIT
. bench/gpu/provenance.sh; record_provenance $R
T0=$(date +%s)
timeout 220 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime/test_engine_gpu.py tests/attention/test_gpu.py > $R/served_check.txt 2>&1; echo "rc=$?" >> $R/served_check.txt; tail -2 $R/served_check.txt; echo "$(( $(date +%s) - T0 )) s"
tar czf $OUT/r47.tgz -C $R .
timeout 290 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/moe > $R/pytest_moe_gpu.txt 2>&1; echo rc=$? >> $R/pytest_moe_gpu.txt; tail -2 $R/pytest_moe_gpu.txt; echo "$(( $(date +%s) - T0 )) s"
