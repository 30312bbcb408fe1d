set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/clocks_start.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -3 $R/pytest_frag.txt
timeout 200 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 30 --config '{}' --config '{"w_stages_gate": 2}' --config '{"w_stages_gate": 2, "x_convert": 1}' --config '{"w_stages_gate": 3, "x_convert": 1}' --config '{"x_convert": 1}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; tail -1 $R/profile.txt
for i in 1 2; do
timeout 120 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{}' --config '{"FRAG_XCONV": 0}' --config '{"FRAG_RING": 0, "FRAG_XCONV": 0}' --out $R/layer$i > $R/layer$i.txt 2>&1; echo rc=$? >> $R/layer$i.txt; tail -1 $R/layer$i.txt
done
timeout 120 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal > $R/goal.txt 2>&1; echo rc=$? >> $R/goal.txt; tail -1 $R/goal.txt
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/clocks_mid.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/moe --deselect tests/moe/test_frag.py > $R/pytest_moe_gpu.txt 2>&1; echo rc=$? >> $R/pytest_moe_gpu.txt; tail -3 $R/pytest_moe_gpu.txt
tar czf $OUT/r19.tgz -C $R .
