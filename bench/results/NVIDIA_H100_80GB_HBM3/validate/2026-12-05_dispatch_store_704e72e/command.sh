#!/usr/bin/env bash
# Run from the repository root at commit 704e72e on one GPU (NVIDIA H100 80GB HBM3; the wheels of optuna, fastapi,
# uvicorn, pydantic installed beside torch), OUT set to an empty folder. Two device calls on one warm machine:
# (1) the GPU suite, tune dispatch (1 rank) and bench moe with the tuned dispatch store, the new CPU tests on a GPU host;
# (2) tune dispatch again (its optuna studies resumed) and the host cost of the per-call lookup (tune/host_cost.txt).
export PDLAB_COMMIT=704e72e
O=$OUT; mkdir -p $O/tune $O/bench_moe $O/extra
(OUT=$O/suite GROUP_TIMEOUT=290 bash bench/gpu/gpu_suite.sh) &
timeout 200 python3 -m pdlab tune dispatch --budget 100s --store $O/tune/configs --out $O/tune --no-progress \
  > $O/tune/log.txt 2>&1
PDLAB_CONFIG_DIR=$O/tune/configs timeout 150 python3 -m pdlab bench moe --dispatch nvfp4 --tokens 1,128,4096 \
  --mode both --runner triton --no-plot --out $O/bench_moe > $O/bench_moe/log.txt 2>&1
wait
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/moe/test_routing_methods.py tests/runtime/test_bad_logits.py \
  tests/moe/test_dispatch_tuned.py > $O/extra/log.txt 2>&1
# host cost: 2000 low-latency local dispatches of 1 token (R1 shapes, bf16), store-read vs explicit config, twice each
PDLAB_CONFIG_DIR=$O/tune/configs python3 bench/results/NVIDIA_H100_80GB_HBM3/validate/2026-12-05_dispatch_store_704e72e/m.py > $O/tune/host_cost.txt
