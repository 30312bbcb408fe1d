set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
which ncu > $R/ncu_path.txt 2>&1 || ls /usr/local/cuda*/bin/ncu >> $R/ncu_path.txt 2>&1
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 300 $NCU --cache-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct -k regex:"_frag_gemm|_prep_x" --csv python3 bench/gpu/profile_decode.py --what frag --tokens 16 --once --config '{"w_stages_gate": 2, "pair_down": 1, "w_stages_down": 2}' > $R/ncu_16.csv 2> $R/ncu_16.err; echo rc=$? >> $R/ncu_16.err; tail -3 $R/ncu_16.err; wc -l $R/ncu_16.csv
tar czf $OUT/r26.tgz -C $R .
