set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -1 $R/pytest_frag.txt
for i in 1 2 3; do
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal$i > $R/goal$i.txt 2>&1; echo rc=$? >> $R/goal$i.txt; tail -1 $R/goal$i.txt
done
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_PDL": 0}' --config '{"FRAG_PDL": 1}' --config '{"FRAG_PAIR_DOWN": 0}' --out $R/ab > $R/ab.txt 2>&1; echo rc=$? >> $R/ab.txt; tail -1 $R/ab.txt
tar czf $OUT/r31.tgz -C $R .
