set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -rA > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; grep -c PASSED $R/pytest_frag.txt; grep -E "FAILED|ERROR" $R/pytest_frag.txt | head -5; tail -2 $R/pytest_frag.txt
for i in 1 2 3; do
timeout 150 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_PDL": 0, "FRAG_XRING": 0}' --config '{"FRAG_PDL": 0, "FRAG_XRING": 1}' --config '{"FRAG_PDL": 1, "FRAG_XRING": 1}' --config '{"FRAG_PDL": 1, "FRAG_XRING": 0}' --config '{"FRAG_RING": 3, "FRAG_XRING": 1}' --out $R/x$i > $R/x$i.txt 2>&1; echo rc=$? >> $R/x$i.txt; tail -1 $R/x$i.txt
done
tar czf $OUT/r28.tgz -C $R .
