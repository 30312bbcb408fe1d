# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0; flashinfer unpacked on the path by the run before
# (bench/gpu/gpu_suite.sh) but not used by these steps. Tree: commit 9b35d59 (the wide kernel's one-box latent load
# on by default). Preamble: the device wheels installed and put on PYTHONPATH, pdlab installed editable.
export PDLAB_COMMIT=9b35d59
for kv in bf16 fp8; do
  timeout 90 python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 32,64,128 \
    --context 8192 --steps 20 --ttft-lens "" --overlap-too --kv-dtype $kv --out $OUT/p/perf_8k_$kv > $OUT/p/perf_8k_$kv.txt 2>&1
done
