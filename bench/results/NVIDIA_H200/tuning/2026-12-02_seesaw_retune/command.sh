# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit 769a44d plus the seesaw kernel (as in
# ../../attention/2026-12-02_seesaw/command.sh). Preamble: the device wheels installed and put on PYTHONPATH, pdlab
# installed editable. The run started from the shipped store (MERGE_SHIPPED=1); flashinfer not searched (its entries
# stay from ../2026-12-02_full_store).
ONLY=att ATT_HEADS=128 ATT_KV=bf16 ATT_BATCH=1,8,32,64,128,256 ATT_SEQLEN=1024,4096,8192,16384 TOTAL_BUDGET=95 \
  SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$OUT/tune timeout 170 bash bench/gpu/tuning.sh
