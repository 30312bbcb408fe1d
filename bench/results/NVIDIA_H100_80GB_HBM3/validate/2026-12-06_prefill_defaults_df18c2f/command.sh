# on one GPU (asked for an H200, given an H100), the tree at commit df18c2f (device wheels installed as the README's GPU notes say)
OUT=$OUT/h200 CONFIGS='{"num_splits":1,"fp8_dequant":0}' bash bench/gpu/prefill_default.sh
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention tests/kernels   # attention_kernels.txt
