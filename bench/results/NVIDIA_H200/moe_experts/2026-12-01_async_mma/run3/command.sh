set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 320 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/moe > $R/pytest_moe_gpu.txt 2>&1; echo rc=$? >> $R/pytest_moe_gpu.txt; tail -2 $R/pytest_moe_gpu.txt
for i in 1 2; do
timeout 110 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal$i > $R/goal$i.txt 2>&1; echo rc=$? >> $R/goal$i.txt; tail -1 $R/goal$i.txt
done
tar czf $OUT/r36.tgz -C $R .
