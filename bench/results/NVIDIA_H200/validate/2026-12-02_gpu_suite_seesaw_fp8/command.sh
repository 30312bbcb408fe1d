# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not on the path. Preamble: the device wheels installed
# and put on PYTHONPATH, pdlab installed editable.
# 1) tree: commit 28378d1
export PDLAB_COMMIT=28378d1
OUT=$OUT/suite GROUP_TIMEOUT=400 bash bench/gpu/gpu_suite.sh
# 2) tree: commit 516ce68 (the failing test's case corrected), the fp8 reference checks again
export PDLAB_COMMIT=516ce68
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py \
  -k "seesaw_decode_over_fp8 or over_fp8_matches" > $OUT/v/fp8_tests.txt 2>&1; echo "rc=$?" >> $OUT/v/fp8_tests.txt
# 3) tree: commit 5a9f4f4 (the two seesaw kernels' partitions share helpers), on a fresh machine
export PDLAB_COMMIT=5a9f4f4
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py > $OUT/f/wide_tests.txt 2>&1
timeout 100 python3 bench/gpu/wide_mla.py --out $OUT/f/w --skip-correctness --variants '{}' '{"seesaw": 0}' --no-baseline \
  --shapes '128,8192,128,1,bf16;128,8192,128,1,fp8;64,8192,128,1,fp8;128,1024,128,1,bf16' > $OUT/f/timing.txt 2>&1
