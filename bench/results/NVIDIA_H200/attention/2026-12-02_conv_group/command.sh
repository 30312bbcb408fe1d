# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Preamble: the device wheels installed and put on PYTHONPATH,
# pdlab installed editable.

# ab/ — at 090f4ba (conv_group a knob, 1 the default): every group against the fp32 reference over fp8 pools
# (72 ragged, NaN-poisoned problems), then the fp8 shapes timed in CUDA graphs, twice, the variants in both orders
export PDLAB_COMMIT=090f4ba
V=('{"conv_group": 1}' '{"conv_group": 3}' '{"conv_group": 9}')
python3 bench/gpu/wide_mla.py --out $OUT/cg/run1 --shape-set wide_fp8 --fp8-only --variants "${V[@]}"
python3 bench/gpu/wide_mla.py --out $OUT/cg/run2 --shape-set wide_fp8 --skip-correctness \
  --variants '{"conv_group": 9}' '{"conv_group": 3}' '{"conv_group": 1}'

# retune/ — at 67b0717 (9 the default): the wide kernel's GPU tests, then the 24 fp8 128-head mla_decode buckets
# re-tuned, merged into the shipped store, and the served check with the merged store
export PDLAB_COMMIT=67b0717
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention/test_gluon_mla_wide.py       # wide_tests.txt
ONLY=att ATT_HEADS=128 ATT_KV=fp8 ATT_BATCH=1,8,32,64,128,256 ATT_SEQLEN=1024,4096,8192,16384 TOTAL_BUDGET=100 \
  SERVED_CHECK=1 MERGE_SHIPPED=1 OUT=$OUT/tune bash bench/gpu/tuning.sh
