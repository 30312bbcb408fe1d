set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -3 $R/pytest_frag.txt
for i in 1 2 3; do
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_PDL": 0}' --config '{"FRAG_PDL": 1}' --out $R/pdl$i > $R/pdl$i.txt 2>&1; echo rc=$? >> $R/pdl$i.txt; tail -1 $R/pdl$i.txt
done
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal > $R/goal.txt 2>&1; echo rc=$? >> $R/goal.txt; tail -1 $R/goal.txt
tar czf $OUT/r27.tgz -C $R .
