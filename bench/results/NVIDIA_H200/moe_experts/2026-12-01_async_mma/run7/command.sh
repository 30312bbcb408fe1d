set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 200 python3 bench/gpu/frag_footprint.py --tokens 1,16,64 > $R/footprint.txt 2>&1; echo rc=$? >> $R/footprint.txt; cat $R/footprint.txt | tail -5
timeout 100 python3 bench/gpu/frag_footprint.py --tokens 16,64 > $R/footprint2.txt 2>&1; echo rc=$? >> $R/footprint2.txt; cat $R/footprint2.txt | tail -3
tar czf $OUT/r40.tgz -C $R .
