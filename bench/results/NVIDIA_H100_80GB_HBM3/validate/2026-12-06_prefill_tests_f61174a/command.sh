# on one GPU (NVIDIA H100 80GB HBM3), the tree at commit f61174a (device wheels installed as the README's GPU notes say)
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/attention -k "prefill or store_kv"
