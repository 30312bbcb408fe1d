set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -k "ring" > $R/pytest_ring.txt 2>&1; echo rc=$? >> $R/pytest_ring.txt; tail -2 $R/pytest_ring.txt
timeout 150 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 30 --events --config '{"w_stages_gate": 2}' --config '{"w_stages_gate": 2, "pair_down": 1, "unroll_down": 1}' --config '{"w_stages_gate": 2, "pair_down": 1, "w_stages_down": 2}' --config '{"w_stages_gate": 2, "pair_down": 1, "w_stages_down": 3}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; tail -1 $R/profile.txt
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{}' --config '{"FRAG_PAIR_DOWN": 1, "FRAG_UNROLL": 1}' --config '{"FRAG_PAIR_DOWN": 1, "FRAG_RING_DOWN": 2}' --out $R/layer > $R/layer.txt 2>&1; echo rc=$? >> $R/layer.txt; tail -1 $R/layer.txt
tar czf $OUT/r22.tgz -C $R .
