# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit 6b54eae (the warm-up's expert launch sizes, the
# layouts' row check, the server's Unicode check). Preamble: the device wheels installed and put on PYTHONPATH, pdlab
# installed editable. The two groups side by side, as bench/gpu/gpu_suite.sh runs them.
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/moe > moe.txt
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime tests/disagg tests/tuning tests/bench tests/test_package.py > runtime_rest.txt
# at bdabd34 (the server's error statuses, disagg with --api-key): the runtime and disagg GPU tests
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime tests/disagg > runtime_disagg_bdabd34.txt
