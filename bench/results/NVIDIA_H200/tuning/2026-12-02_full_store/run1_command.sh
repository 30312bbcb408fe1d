set -u
R=$TMPDIR/r45; mkdir -p $R
trap 'tar czf $OUT/r45.tgz -C $R . 2>/dev/null' EXIT
. bench/gpu/provenance.sh; record_provenance $R
T0=$(date +%s)
ALLB=1,8,32,64,128,256; ALLS=1024,4096,8192,16384
ONLY=att ATT_HEADS=128 ATT_KV=bf16,fp8 ATT_BATCH=$ALLB ATT_SEQLEN=$ALLS TOTAL_BUDGET=130 SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$R/t1 timeout 200 bash bench/gpu/tuning.sh > $R/t1.txt 2>&1; echo "t1 rc=$? $(( $(date +%s) - T0 )) s"
tar czf $OUT/r45.tgz -C $R .
mkdir -p $R/t2 && cp -r $R/t1/configs $R/t2/configs
LEFT=$(( 540 - ($(date +%s) - T0) - 40 ))
ONLY=att ATT_HEADS=16 ATT_KV=bf16,fp8 ATT_BATCH=$ALLB ATT_SEQLEN=$ALLS TOTAL_BUDGET=$LEFT SERVED_CHECK=0 MERGE_SHIPPED=0 OUT=$R/t2 timeout $(( LEFT + 35 )) bash bench/gpu/tuning.sh > $R/t2.txt 2>&1; echo "t2 rc=$? budget $LEFT $(( $(date +%s) - T0 )) s"
tail -5 $R/t1/summary.txt $R/t2/summary.txt
