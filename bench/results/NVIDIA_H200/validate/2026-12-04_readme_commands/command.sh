# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer and DeepEP not installed. Tree: commit cdd7c85.
# Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable.
export PDLAB_COMMIT=cdd7c85
OUT=$OUT/readme bash bench/gpu/readme_commands.sh
