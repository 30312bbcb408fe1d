# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer-python 0.7.2.post1 (unpacked by
# bench/gpu/flashinfer_env.sh). Tree: commit 9b35d59. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable.
export PDLAB_COMMIT=9b35d59
OUT=$OUT/suite GROUP_TIMEOUT=390 bash bench/gpu/gpu_suite.sh
