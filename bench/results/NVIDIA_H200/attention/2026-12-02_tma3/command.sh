# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable. Tree: 2862c9f (tma3 a knob, off by default).
export PDLAB_COMMIT=2862c9f
# run1: every variant against the fp32 reference (--quick: 128 and 64 heads S_q 1, 128 heads S_q 2; pages 64/128;
# bf16 with splits 0/1/3/16, fp8 with 0/3), then B=128 8k bf16 and fp8 timed
python3 bench/gpu/wide_mla.py --out $OUT/t3/run1 --quick --check-variants --no-baseline \
  --variants '{"tma3": 1}' '{"tma3": 0}' --shapes '128,8192,128,1,bf16;128,8192,128,1,fp8'
# run2: eight shapes timed, the variants in the other order
python3 bench/gpu/wide_mla.py --out $OUT/t3/run2 --skip-correctness --no-baseline --variants '{"tma3": 0}' '{"tma3": 1}' \
  --shapes '128,16384,128,1,bf16;64,8192,128,1,bf16;32,8192,128,1,fp8;128,1024,128,1,bf16;128,8192,128,2,bf16;8,4096,128,1,bf16;128,8192,128,1,bf16;128,16384,128,1,fp8'
# the same tree with tma3 1 as the default (the change committed next): the wide kernel's GPU tests, then the runtime's
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py -x          # wide_tests_tma3.txt
timeout 50 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  "tests/runtime/test_engine_gpu.py::test_served_fp8_decode_calls_match_reference" tests/runtime/test_engine_gpu.py -x
