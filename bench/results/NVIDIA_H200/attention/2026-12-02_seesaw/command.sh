# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not on the path. Tree: commit 769a44d plus the
# seesaw kernel as committed in 131c38a (attention/gluon_mla_seesaw.py; before that commit an unused kernel argument
# and helper parameter were removed: compiled for sm90 with Triton 3.6, the committed kernel's SASS is the one that
# ran here instruction for instruction, but for constant-bank offsets). Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable. The tests and
# the correctness checks ran side by side; the timings after the checks, alone on the GPU.
R=$OUT/r; mkdir -p $R
(timeout 330 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py tests/runtime \
  tests/tuning > $R/tests.txt 2>&1; echo "rc=$?" >> $R/tests.txt) &
timeout 330 python3 bench/gpu/wide_mla.py --out $R/w --variants '{}' '{"seesaw": 0}' --no-baseline \
  --shapes '128,8192,128,1,bf16;128,16384,128,1,bf16;128,4096,128,1,bf16;128,1024,128,1,bf16;64,8192,128,1,bf16;32,8192,128,1,bf16;8,1024,128,1,bf16;8,4096,128,1,bf16;1,8192,128,1,bf16;128,8192,128,2,bf16;128,8192,64,1,bf16;128,8192,16,4,bf16' \
  > $R/wide.txt 2>&1
wait
