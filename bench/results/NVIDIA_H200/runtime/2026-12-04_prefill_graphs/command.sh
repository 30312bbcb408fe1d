# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable.
# tests.txt, tiny_*.txt, synthetic_deepseek-r1_4_*.txt: tree 144330f (prefill graphs off by default, on by the flag)
export PDLAB_COMMIT=144330f
OUT=$OUT/pg bash bench/gpu/prefill_graphs.sh
# runtime_rest_gpu_tests_559d0d4.txt: tree 559d0d4 (prefill graphs on by default, 256 tokens): every GPU test of
# the runtime, disaggregation, tuning, bench and the package (the gpu_suite.sh group these settings reach)
python3 -m pytest -q -rs -p no:cacheprovider -m gpu --durations=10 tests/runtime tests/disagg tests/tuning tests/bench \
  tests/test_package.py
