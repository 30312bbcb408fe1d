# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer-python 0.7.2.post1 (its Python files, headers and MLA
# sources unpacked by bench/gpu/flashinfer_env.sh; fa3 JIT-compiled there with nvcc 13.0).
# Every command below starts with the device preamble: the device wheels (optuna, fastapi, ..., apache-tvm-ffi)
# installed to $DEVICE_WHEELS and put on PYTHONPATH, pdlab installed editable, PDLAB_COMMIT set to the commit.

# run1_module_wrapper (094a928): re-plans through flashinfer's generated-module wrapper
OUT=$OUT/cost bash bench/gpu/flashinfer_graphs.sh cost
OUT=$OUT/perf8k bash bench/gpu/flashinfer_graphs.sh perf      # flashinfer unpacked only for the second half
OUT=$OUT/tests bash bench/gpu/flashinfer_graphs.sh tests

# run2_profile (be777a0): where the step time goes at batch 8, 8k context
python3 -m pdlab.bench.gpu.graph_step_profile --batch 8 --out $OUT/without            # without flashinfer
. bench/gpu/flashinfer_env.sh
python3 -m pdlab.bench.gpu.graph_step_profile --batch 8 --out $OUT/with
python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 8 \
  --context 8192 --steps 20 --ttft-lens "" --profile-host 8 --out $OUT/host

# run3_final (5377065): re-plans through the compiled plan into pinned ring buffers
OUT=$OUT/cost bash bench/gpu/flashinfer_graphs.sh cost
OUT=$OUT/perf8k bash bench/gpu/flashinfer_graphs.sh perf
. bench/gpu/flashinfer_env.sh
python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not multigpu" tests/attention/test_flashinfer_gpu.py tests/runtime
# at b1ca39e (the fp8 tests' reference rounds the scale to bf16 as flashinfer does), six times with fresh seeds:
python3 -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_flashinfer_gpu.py -k "fp8 or replayed"
