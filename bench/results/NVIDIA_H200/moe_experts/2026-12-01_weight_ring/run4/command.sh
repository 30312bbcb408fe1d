set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -2 $R/pytest_frag.txt
timeout 150 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 30 --events --config '{"w_stages_gate": 2}' --config '{}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; tail -1 $R/profile.txt
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal > $R/goal.txt 2>&1; echo rc=$? >> $R/goal.txt; tail -1 $R/goal.txt
tar czf $OUT/r21.tgz -C $R .
