# tree: 4cbcd7c (the device checkout's git HEAD was older: the store's metadata said f438b34-dirty and
# flashinfer-python null, the flashinfer files having been unpacked without their dist-info; both fields were
# corrected to 4cbcd7c and 0.7.2.post1 in the shipped file, nothing else was changed)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e .
PREFILL_PARTS=1 DECODE_ROWS=0 PYTHONUNBUFFERED=1 timeout 560 bash bench/gpu/flashinfer_tune.sh
