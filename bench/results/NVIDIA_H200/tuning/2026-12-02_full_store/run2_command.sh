set -u
R=$TMPDIR/r46; mkdir -p $R
trap 'tar czf $OUT/r46.tgz -C $R . 2>/dev/null' EXIT
. bench/gpu/provenance.sh; record_provenance $R
T0=$(date +%s)
ONLY=att ATT_HEADS=128 ATT_KV=bf16,fp8 ATT_BATCH=256 ATT_SEQLEN=8192,16384 TOTAL_BUDGET=40 SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$R/att timeout 120 bash bench/gpu/tuning.sh > $R/att.txt 2>&1; echo "att rc=$? $(( $(date +%s) - T0 )) s"
ONLY=moe MOE_EXPERTS=64 MOE_TPE=1,16,64 MOE_ACTIVE=64 MOE_LAYOUT=masked,contiguous MOE_PAYLOAD=bf16,nvfp4 TOTAL_BUDGET=90 SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$R/moe1 timeout 170 bash bench/gpu/tuning.sh > $R/moe1.txt 2>&1; echo "moe1 rc=$? $(( $(date +%s) - T0 )) s"
tar czf $OUT/r46.tgz -C $R .
mkdir -p $R/moe2 && cp -r $R/moe1/configs $R/moe2/configs
ONLY=moe MOE_EXPERTS=256 MOE_TPE=1,16,64 MOE_ACTIVE=256 MOE_LAYOUT=masked MOE_PAYLOAD=bf16,nvfp4 TOTAL_BUDGET=80 SERVED_CHECK=0 MERGE_SHIPPED=0 OUT=$R/moe2 timeout 170 bash bench/gpu/tuning.sh > $R/moe2.txt 2>&1; echo "moe2 rc=$? $(( $(date +%s) - T0 )) s"
