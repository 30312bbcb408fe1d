# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not installed. Tree: commit 07efd8b (the wide
# kernel converts an fp8 tile behind one barrier). Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable.
export PDLAB_COMMIT=07efd8b
for kv in bf16 fp8; do
  python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 32,64,128 \
    --context 8192 --steps 20 --ttft-lens "" --overlap-too --kv-dtype $kv --out $OUT/p/perf_8k_$kv
done
