# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit 9b35d59. Preamble: the device wheels installed and
# put on PYTHONPATH, pdlab installed editable. The run started from the shipped store (MERGE_SHIPPED=1).
export PDLAB_COMMIT=9b35d59
ONLY=att ATT_HEADS=128 ATT_KV=bf16,fp8 ATT_BATCH=1,8,32,64,128,256 ATT_SEQLEN=1024,4096,8192,16384 TOTAL_BUDGET=130 \
  SERVED_CHECK=1 MERGE_SHIPPED=1 OUT=$OUT/tune bash bench/gpu/tuning.sh
