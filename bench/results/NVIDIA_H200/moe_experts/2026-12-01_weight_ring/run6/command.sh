set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/moe > $R/pytest_moe_gpu.txt 2>&1; echo rc=$? >> $R/pytest_moe_gpu.txt; tail -2 $R/pytest_moe_gpu.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime/test_engine_gpu.py > $R/pytest_runtime_gpu.txt 2>&1; echo rc=$? >> $R/pytest_runtime_gpu.txt; tail -2 $R/pytest_runtime_gpu.txt
timeout 80 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --repeats 30 --events --config '{"w_stages_gate": 2, "pair_down": 1, "w_stages_down": 2}' --config '{"w_stages_gate": 2, "pair_down": 1, "w_stages_down": 2, "prep_block": 512}' --out $R/profile > $R/profile.txt 2>&1; echo rc=$? >> $R/profile.txt; tail -1 $R/profile.txt
for i in 1 2; do
timeout 70 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --out $R/goal$i > $R/goal$i.txt 2>&1; echo rc=$? >> $R/goal$i.txt; tail -1 $R/goal$i.txt
done
timeout 110 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1; echo rc=$? >> $R/bench_moe.txt; tail -1 $R/bench_moe.txt
tar czf $OUT/r23.tgz -C $R .
