# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit cb6ed3d. Preamble: the device wheels installed and
# put on PYTHONPATH, pdlab installed editable. The run started from the shipped store (MERGE_SHIPPED=1); the
# attention timings of ../../attention/2026-12-02_seesaw_fp8 ran just before it, the decode step of
# ../../runtime/2026-12-02_seesaw_fp8_step just after, with the store it wrote.
export PDLAB_COMMIT=cb6ed3d
ONLY=att ATT_HEADS=128 ATT_KV=fp8 ATT_BATCH=1,8,32,64,128,256 ATT_SEQLEN=1024,4096,8192,16384 TOTAL_BUDGET=110 \
  SERVED_CHECK=1 MERGE_SHIPPED=1 OUT=$OUT/tune bash bench/gpu/tuning.sh
