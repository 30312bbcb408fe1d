set -u
unset TRITON_INTERPRET
mkdir -p $OUT/p
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -k "cp_async or stored_in_fragment" -rfE > $OUT/p/pytest_xasync.txt 2>&1
echo "rc=$?" >> $OUT/p/pytest_xasync.txt; tail -2 $OUT/p/pytest_xasync.txt
timeout 300 python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64 --config '{}' --config '{"x_async": 1}' \
  --config '{"x_async": 1, "unroll_down": 1}' --config '{"unroll_gate": 2}' --config '{"x_async": 1, "unroll_gate": 2}' --out $OUT/p > $OUT/p/profile.txt 2>&1
echo "rc=$?" >> $OUT/p/profile.txt
cat $OUT/p/profile.txt | cut -c1-200 | tail -50
