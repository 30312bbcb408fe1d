set -u
R=${OUT:-/tmp}/run; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 bench/gpu/sparse_experts.py --tokens 1 --profile --config '{}' --config '{"FRAG_RING": 0, "FRAG_PAIR_DOWN": 0}' --config '{"FRAG_PAIR_DOWN": 0}' > $R/sparse.txt 2>&1; echo rc=$? >> $R/sparse.txt; grep -v "^\s*$" $R/sparse.txt | cut -c1-200 | tail -75
tar czf $OUT/r25.tgz -C $R .
