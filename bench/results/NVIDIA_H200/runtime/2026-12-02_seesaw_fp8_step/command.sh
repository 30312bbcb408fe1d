# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit cb6ed3d. Preamble: the device wheels installed and
# put on PYTHONPATH, pdlab installed editable. Run right after ../../tuning/2026-12-02_seesaw_fp8_retune, with the
# store it wrote (the shipped one: the same file).
export PDLAB_COMMIT=cb6ed3d
PDLAB_CONFIG_DIR=$OUT/tune/configs timeout 90 python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 \
  --device cuda --batch-sizes 32,64,128 --context 8192 --steps 20 --ttft-lens "" --overlap-too --kv-dtype fp8 \
  --out $OUT/p/perf_8k_fp8 > $OUT/p/perf_8k_fp8.txt 2>&1
# the bf16 step, a later run on a fresh machine; tree: commit 516ce68 (shipped store)
export PDLAB_COMMIT=516ce68
timeout 120 python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 32,64,128 \
  --context 8192 --steps 20 --ttft-lens "" --overlap-too --kv-dtype bf16 --out $OUT/p/perf_8k_bf16 > $OUT/p/perf_8k_bf16.txt 2>&1
