set -u
unset TRITON_INTERPRET
mkdir -p $OUT/t $OUT/tune/configs/NVIDIA_H200
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -x -rfE > $OUT/t/pytest_frag_gpu3.txt 2>&1
echo "rc=$?" >> $OUT/t/pytest_frag_gpu3.txt; tail -2 $OUT/t/pytest_frag_gpu3.txt
timeout 100 python3 -m pdlab.bench.moe_experts --shapes decode --experts 64 --hidden 7168 --inter 2048 --decode-tokens 1,16,64 \
  --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_XASYNC":0}' --out $OUT/t/bench > $OUT/t/bench.txt 2>&1
echo "rc=$?" >> $OUT/t/bench.txt; grep -E "triton" $OUT/t/bench.txt | cut -c1-150
cp tuning/configs/NVIDIA_H200/moe_experts.json $OUT/tune/configs/NVIDIA_H200/
export OUT_T=$OUT/tune
OUT=$OUT_T/masked ONLY=moe TOTAL_BUDGET=150 MOE_LAYOUT=masked MOE_PAYLOAD=bf16,nvfp4 MOE_TPE=1,16,64 MOE_EXPERTS=64,256 \
  bash -c 'sed "s#export PDLAB_CONFIG_DIR=\"\$OUT/configs\"#export PDLAB_CONFIG_DIR=\"$OUT_T/configs\"#" bench/gpu/tuning.sh > /tmp/tuning_m.sh; bash /tmp/tuning_m.sh' > $OUT_T/masked.txt 2>&1
OUT=$OUT_T/contig ONLY=moe TOTAL_BUDGET=130 MOE_LAYOUT=contiguous MOE_PAYLOAD=nvfp4 MOE_TPE=4,64,256,1024 MOE_EXPERTS=64,256 \
  bash -c 'sed "s#export PDLAB_CONFIG_DIR=\"\$OUT/configs\"#export PDLAB_CONFIG_DIR=\"$OUT_T/configs\"#" bench/gpu/tuning.sh > /tmp/tuning_c.sh; bash /tmp/tuning_c.sh' > $OUT_T/contig.txt 2>&1
grep -h "moe_experts:" $OUT_T/masked.txt $OUT_T/contig.txt
cd $OUT && tar czf res.tgz t tune && rm -rf tune t/bench
