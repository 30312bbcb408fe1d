set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
for i in 1 2; do
timeout 110 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal$i > $R/goal$i.txt 2>&1; echo rc=$? >> $R/goal$i.txt; tail -1 $R/goal$i.txt
done
timeout 80 python3 bench/gpu/sparse_experts.py --tokens 1,16 --config '{}' --config '{"FRAG_MMA_ASYNC": 1}' --config '{}' --config '{"FRAG_MMA_ASYNC": 1}' > $R/sparse.txt 2>&1; echo rc=$? >> $R/sparse.txt; tail -1 $R/sparse.txt
tar czf $OUT/r39.tgz -C $R .
