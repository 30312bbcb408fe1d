# on one GPU (device wheels installed as the README's GPU notes say)
# first_run/: the tree at d9c860d (prefill default: one split)
HEADS=16 BUDGET=140 OUT=$OUT/prefill16 bash bench/gpu/tune_prefill.sh
# default_bench/ and retune/: the tree at 259b35f (prefill default: num_splits 0, waves 1)
OUT=$OUT/pd CONFIGS='{"num_splits":1} {"num_splits":2}' bash bench/gpu/prefill_default.sh
HEADS=16 BUDGET=90 OUT=$OUT/t16 bash bench/gpu/tune_prefill.sh
