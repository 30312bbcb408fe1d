# tree: c9b6014 (the device checkout's git HEAD was older, so tree_status.txt lists this tree's changes against it)
# .whl/: the device wheels, apache_tvm_ffi-0.1.15.post2 (cp312) and flashinfer_trim.tar.xz (flashinfer-python
# 0.7.2.post1's Python files, headers and MLA sources; see bench/gpu/flashinfer_env.sh)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e .
PYTHONUNBUFFERED=1 bash bench/gpu/flashinfer.sh
