# on one GPU, the tree at commit 463a575 (device wheels installed as the README's GPU notes say)
OUT=$OUT/prefill HEADS=128 BUDGET=200 bash bench/gpu/tune_prefill.sh
