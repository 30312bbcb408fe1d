# tree: 6035a08 (the device checkout's git HEAD was older: the store's metadata said f438b34-dirty; corrected to
# 6035a08 in the shipped file, nothing else changed). flashinfer's dist-info now travels in the tarball, so the
# store records flashinfer-python 0.7.2.post1 itself.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e .
KV=fp8 TOTAL_BUDGET=190 PYTHONUNBUFFERED=1 timeout 555 bash bench/gpu/flashinfer_tune.sh
