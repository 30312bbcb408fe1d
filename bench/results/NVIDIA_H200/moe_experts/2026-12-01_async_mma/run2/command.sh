set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
P="python3 bench/gpu/profile_decode.py --what frag"
C0='{"w_stages_gate": 2, "x_ring": 1, "w_stages_down": 2, "pair_down": 1}'
C1='{"w_stages_gate": 2, "x_ring": 1, "w_stages_down": 2, "pair_down": 1, "mma_async": 1}'
timeout 150 $P --tokens 16,64 --events --config "$C0" --config "$C1" --out $R/prof > $R/prof.txt 2>&1; echo rc=$? >> $R/prof.txt; tail -1 $R/prof.txt
NCU="ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats"
timeout 150 $NCU -k regex:_frag_gemm --launch-skip 2 --launch-count 2 $P --tokens 64 --once --config "$C1" > $R/ncu64_async.txt 2>&1; echo rc=$? >> $R/ncu64_async.txt; tail -1 $R/ncu64_async.txt
timeout 120 $NCU -k regex:_frag_gemm --launch-skip 2 --launch-count 2 $P --tokens 64 --once --config "$C0" > $R/ncu64_sync.txt 2>&1; echo rc=$? >> $R/ncu64_sync.txt; tail -1 $R/ncu64_sync.txt
timeout 120 $NCU -k regex:_frag_gemm --launch-skip 2 --launch-count 2 $P --tokens 16 --once --config "$C1" > $R/ncu16_async.txt 2>&1; echo rc=$? >> $R/ncu16_async.txt; tail -1 $R/ncu16_async.txt
tar czf $OUT/r35.tgz -C $R .
