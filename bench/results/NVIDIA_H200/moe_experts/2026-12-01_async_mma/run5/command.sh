set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 120 python3 bench/gpu/sparse_experts.py --tokens 1,16,128 --config '{"FRAG_MMA_ASYNC": 0}' --config '{"FRAG_MMA_ASYNC": 1}' --config '{"FRAG_MMA_ASYNC": 0}' --config '{"FRAG_MMA_ASYNC": 1}' > $R/sparse_ab.txt 2>&1; echo rc=$? >> $R/sparse_ab.txt; tail -30 $R/sparse_ab.txt
timeout 150 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1; echo rc=$? >> $R/bench_moe.txt; tail -1 $R/bench_moe.txt
tar czf $OUT/r38.tgz -C $R .
