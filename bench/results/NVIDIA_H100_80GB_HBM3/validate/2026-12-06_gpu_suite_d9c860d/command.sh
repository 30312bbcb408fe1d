# on one GPU, the tree at commit d9c860d (device wheels installed as the README's GPU notes say)
OUT=$OUT/suite GROUP_TIMEOUT=250 bash bench/gpu/gpu_suite.sh
