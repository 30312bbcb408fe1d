# run on the device machine from the repository root at d38bb57 ($OUT: the folder whose files came back)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PDLAB_COMMIT=d38bb57
OUT=$OUT/slab TEST_TIMEOUT=220 bash bench/gpu/slab_schedule.sh
