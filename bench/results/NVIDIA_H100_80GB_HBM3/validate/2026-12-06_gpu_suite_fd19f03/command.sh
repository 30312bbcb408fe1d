# device checkout at fd19f03, one H100 80GB; wheels of optuna/fastapi/... installed into a side folder first
python3 -m pip install -q --no-deps --no-build-isolation -e .
export PDLAB_COMMIT=fd19f03
OUT=$OUT/suite GROUP_TIMEOUT=255 bash bench/gpu/gpu_suite.sh
