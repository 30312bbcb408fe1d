# one H200 (kind nvidia-h200), repository root at fca123b, after installing the optional wheels (optuna, fastapi,
# uvicorn, pydantic) and `python3 -m pip install --no-deps --no-build-isolation -e .`
export PDLAB_COMMIT=fca123b
OUT=$OUT/suite GROUP_TIMEOUT=470 bash bench/gpu/gpu_suite.sh
