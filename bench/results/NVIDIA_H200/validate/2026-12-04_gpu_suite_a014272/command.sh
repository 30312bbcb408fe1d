# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not installed (its tests skip). Tree: commit
# a014272. Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable.
export PDLAB_COMMIT=a014272
OUT=$OUT/suite GROUP_TIMEOUT=330 bash bench/gpu/gpu_suite.sh
