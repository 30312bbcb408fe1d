# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer-python 0.7.2.post1 (unpacked by
# bench/gpu/flashinfer_env.sh; its MLA kernels JIT-compiled with nvcc). Tree: commit 1f9f930 (= 60375d9 + this
# script). Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable.
export PDLAB_COMMIT=1f9f930 CUDA_HOME=/usr/local/cuda
OUT=$OUT/suite GROUP_TIMEOUT=500 bash bench/gpu/gpu_suite.sh
