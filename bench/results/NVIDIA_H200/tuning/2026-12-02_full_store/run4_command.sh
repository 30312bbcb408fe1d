set -u
R=$TMPDIR/r48; mkdir -p $R
trap 'tar czf $OUT/r48.tgz -C $R . 2>/dev/null' EXIT
. bench/gpu/provenance.sh; record_provenance $R
T0=$(date +%s)
ONLY=moe MOE_EXPERTS=64,256 MOE_TPE=64 MOE_ACTIVE=64,256 MOE_LAYOUT=masked MOE_PAYLOAD=bf16 TOTAL_BUDGET=60 SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$R/moe timeout 150 bash bench/gpu/tuning.sh > $R/moe.txt 2>&1; echo "moe rc=$? $(( $(date +%s) - T0 )) s"
head -3 $R/moe/summary.txt
