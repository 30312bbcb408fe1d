set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/clocks_start.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -k "ring or pre_kernel" > $R/pytest_ring.txt 2>&1; echo rc=$? >> $R/pytest_ring.txt; tail -3 $R/pytest_ring.txt
timeout 220 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 20 --config '{}' --config '{"prep_gather": 1}' --config '{"w_stages_gate": 2}' --config '{"w_stages_gate": 3}' --config '{"w_stages_gate": 4}' --config '{"w_stages_gate": 2, "maxnreg_gate": 128}' --config '{"w_stages_down": 3}' --config '{"w_stages_down": 4}' --config '{"w_stages_down": 6}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; grep -v Warn $R/profile.txt | grep "{" | sed 's/"what": "frag", //' | cut -c1-160
timeout 150 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked --payloads bf16 --runners triton,torch_grouped --weights-layout fragment --config '{}' --config '{"FRAG_RING": 2, "FRAG_RING_DOWN": 4}' --config '{"FRAG_RING": 3, "FRAG_RING_DOWN": 4}' --config '{"FRAG_RING": 2, "FRAG_RING_DOWN": 4, "FRAG_MAXNREG": 128}' --out $R/layer > $R/layer.txt 2>&1; echo rc=$? >> $R/layer.txt; grep -v Warn $R/layer.txt | tail -25 | cut -c1-200
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/clocks_end.txt
tar czf $OUT/r18.tgz -C $R .
