set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -2 $R/pytest_frag.txt
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked --payloads bf16 --runners triton,torch_grouped --weights-layout fragment --out $R/goal > $R/goal.txt 2>&1; echo rc=$? >> $R/goal.txt; tail -1 $R/goal.txt
tar czf $OUT/r41.tgz -C $R .
