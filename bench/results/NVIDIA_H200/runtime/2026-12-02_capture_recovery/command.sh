# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer-python 0.7.2.post1 (unpacked by
# bench/gpu/flashinfer_env.sh, fa3 JIT-compiled with nvcc). Commit 5ec95f5. Every command starts with the device
# preamble: the device wheels installed to $DEVICE_WHEELS and put on PYTHONPATH, pdlab installed editable.
# $FI_SITE: the folder flashinfer_env.sh unpacked flashinfer into ("with flashinfer" puts it on PYTHONPATH).

# what a failed capture leaves behind, torch.cuda.graph against capture_graph (capture_failure_probe.txt)
python3 -m pdlab.bench.gpu.capture_failure_probe
# the capture-recovery GPU tests (capture_tests.txt)
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/kernels/test_graphs_gpu.py \
  "tests/runtime/test_engine_gpu.py::test_a_failed_graph_capture_serves_eagerly_and_leaves_the_process_usable"
# flashinfer's GPU tests and the runtime's, with and without flashinfer; the re-plan cost (tests_summary.txt)
OUT=$OUT/fi bash bench/gpu/flashinfer_graphs.sh tests
OUT=$OUT/fi bash bench/gpu/flashinfer_graphs.sh cost

# decode through the graphs, without and with flashinfer, in pairs (perf_ab/, decode_ab.csv, decode_ab_summary.csv)
OUT=$OUT/perf bash bench/gpu/flashinfer_graphs.sh perf                                        # pair A1, 20 steps
for i in 1 2 3; do for w in without with; do                                                  # pairs B1-B3, 40 steps
  PYTHONPATH=$([ $w = with ] && echo $FI_SITE:)$PYTHONPATH python3 -m pdlab.runtime.engine.perf \
    --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 1,8,32,64,128 --context 8192 --steps 40 \
    --ttft-lens "" --overlap-too --out $OUT/${w}_$i
done; done
for i in 1 2; do for w in with without; do                                                    # pairs C1-C2, 60 steps, with first
  PYTHONPATH=$([ $w = with ] && echo $FI_SITE:)$PYTHONPATH python3 -m pdlab.runtime.engine.perf \
    --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 8,64,128 --context 8192 --steps 60 \
    --ttft-lens "" --overlap-too --out $OUT/${w}_$i
done; done

# torch.profiler over 20 graph decode steps (profiles/), each without and with flashinfer
python3 -m pdlab.bench.gpu.graph_step_profile --batch 8 --steps 20 --out $OUT/without
python3 -m pdlab.bench.gpu.graph_step_profile --batch 8 --steps 20 --overlap --out $OUT/without
python3 -m pdlab.bench.gpu.graph_step_profile --batch 64 --steps 20 --out $OUT/without

# at 39e7973 (perf times the overlap schedule as a pipelined run): three pairs, D2 with flashinfer first (perf_pipelined/)
for i in 1 2 3; do for w in without with; do
  PYTHONPATH=$([ $w = with ] && echo $FI_SITE:)$PYTHONPATH python3 -m pdlab.runtime.engine.perf \
    --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 8,32,64,128 --context 8192 --steps 40 \
    --ttft-lens "" --overlap-too --out $OUT/${w}_$i
done; done

# the harness case (harness_tests.txt), at the tree of the commit that adds it
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/bench/test_harness.py tests/kernels/test_graphs_gpu.py

# the decode goal row at context 1024, without flashinfer, twice (perf_ctx1k/)
python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 64,256 \
  --context 1024 --steps 40 --ttft-lens "" --overlap-too --out $OUT/ctx1k_$i
