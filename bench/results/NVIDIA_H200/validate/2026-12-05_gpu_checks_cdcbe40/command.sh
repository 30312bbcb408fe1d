# one H200, tree cdcbe40, 2026-12-05 ~08:47-08:56 UTC (two calls)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e .; export PDLAB_COMMIT=cdcbe40
OUT=$OUT/suite GROUP_TIMEOUT=280 bash bench/gpu/gpu_suite.sh
bench quantize --out $OUT/q
# second call, the kernels group the first one's time limit cut:
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/kernels tests/moe/test_probe_ops_routing.py \
  tests/moe/test_probe_ops_experts.py
