set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
for i in 1 2; do
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal$i > $R/goal$i.txt 2>&1; echo rc=$? >> $R/goal$i.txt; tail -1 $R/goal$i.txt
done
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{}' --config '{"FRAG_RING_DOWN": 2}' --config '{"FRAG_PAIR_DOWN": 1, "FRAG_RING_DOWN": 2}' --config '{"FRAG_XRING": 0}' --out $R/down64 > $R/down64.txt 2>&1; echo rc=$? >> $R/down64.txt; tail -1 $R/down64.txt
timeout 150 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1; echo rc=$? >> $R/bench_moe.txt; tail -1 $R/bench_moe.txt
tar czf $OUT/r30.tgz -C $R .
