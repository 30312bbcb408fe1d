set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -3 $R/pytest_frag.txt
timeout 120 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 30 --config '{"w_stages_gate": 2}' --config '{"w_stages_gate": 2, "x_convert": 1}' --config '{"x_convert": 1}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; tail -1 $R/profile.txt
for i in 1 2; do
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_XCONV": 1}' --config '{"FRAG_XCONV": 0}' --out $R/layer$i > $R/layer$i.txt 2>&1; echo rc=$? >> $R/layer$i.txt; tail -1 $R/layer$i.txt
done
tar czf $OUT/r20.tgz -C $R .
