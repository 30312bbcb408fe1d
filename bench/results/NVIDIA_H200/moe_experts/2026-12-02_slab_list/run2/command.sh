# run on the device machine from the repository root at 6850a0b ($OUT: the folder whose files came back)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PDLAB_COMMIT=6850a0b
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -k "slab or block_schedule or decode_default" 2>&1 | tail -5 > $OUT/tests_slab.txt
ONLY=moe MOE_TPE=1 MOE_EXPERTS=256,64 MOE_ACTIVE=8,32,128 MOE_LAYOUT=masked MOE_PAYLOAD=bf16,nvfp4 TOTAL_BUDGET=170 \
  SERVED_CHECK=0 MERGE_SHIPPED=1 OUT=$OUT/tune bash bench/gpu/tuning.sh
export PDLAB_CONFIG_DIR=$OUT/tune/configs
for E in 256 64; do
  timeout 80 python3 bench/gpu/sparse_experts.py --experts $E --tokens 1,4,16 --slab-rows 256 \
    --config '{"FRAG_BM": 0}' --config '{}' >> $OUT/sparse_after.jsonl 2>&1
done
