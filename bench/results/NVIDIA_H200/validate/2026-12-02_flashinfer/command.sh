# tree fb1b761; .whl/ as in attention/2026-12-02_flashinfer (flashinfer-python 0.7.2.post1 files)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e .
PYTHONUNBUFFERED=1 PDLAB_COMMIT=fb1b761 timeout 490 bash bench/gpu/flashinfer_validate.sh
