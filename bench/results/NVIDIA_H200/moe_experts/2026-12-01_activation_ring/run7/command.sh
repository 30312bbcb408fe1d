set -u
R=$OUT; mkdir -p $R/tune/configs/NVIDIA_H200
cp tuning/configs/NVIDIA_H200/moe_experts.json $R/tune/configs/NVIDIA_H200/
ONLY=moe MOE_TPE=1,16,64 MOE_EXPERTS=64 MOE_LAYOUT=masked,contiguous MOE_PAYLOAD=bf16,nvfp4 TOTAL_BUDGET=240 SERVED_CHECK=0 OUT=$R/tune bash bench/gpu/tuning.sh > $R/tune.txt 2>&1; echo rc=$? >> $R/tune.txt; tail -25 $R/tune.txt
PDLAB_CONFIG_DIR=$R/tune/configs timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/runtime/test_engine_gpu.py > $R/served_check.txt 2>&1; echo rc=$? >> $R/served_check.txt; tail -2 $R/served_check.txt
rm -rf $R/tune/cache
tar czf $OUT/r33.tgz -C $R .
