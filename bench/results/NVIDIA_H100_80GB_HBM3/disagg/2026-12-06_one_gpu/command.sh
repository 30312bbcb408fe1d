# device checkout, one H100 80GB; wheels of optuna/fastapi/... installed into a side folder first
python3 -m pip install -q --no-deps --no-build-isolation -e .
export PDLAB_COMMIT=b9a409b   # run 1: fd19f03
OUT=$OUT/disagg2 timeout 300 bash bench/gpu/disagg_one_gpu.sh
