set -u
unset TRITON_INTERPRET
mkdir -p $OUT/t $OUT/tune/configs/NVIDIA_H200
cp tuning/configs/NVIDIA_H200/moe_experts.json $OUT/tune/configs/NVIDIA_H200/
export OUT_T=$OUT/tune
OUT=$OUT_T/masked ONLY=moe TOTAL_BUDGET=120 MOE_LAYOUT=masked MOE_PAYLOAD=bf16,nvfp4 MOE_TPE=1,16,64 MOE_EXPERTS=64,256 \
  bash -c 'sed "s#export PDLAB_CONFIG_DIR=\"\$OUT/configs\"#export PDLAB_CONFIG_DIR=\"$OUT_T/configs\"#" bench/gpu/tuning.sh > /tmp/tuning_m.sh; bash /tmp/tuning_m.sh' > $OUT_T/masked.txt 2>&1
OUT=$OUT_T/contig ONLY=moe TOTAL_BUDGET=110 MOE_LAYOUT=contiguous MOE_PAYLOAD=nvfp4 MOE_TPE=4,64,256,1024 MOE_EXPERTS=64,256 \
  bash -c 'sed "s#export PDLAB_CONFIG_DIR=\"\$OUT/configs\"#export PDLAB_CONFIG_DIR=\"$OUT_T/configs\"#" bench/gpu/tuning.sh > /tmp/tuning_c.sh; bash /tmp/tuning_c.sh' > $OUT_T/contig.txt 2>&1
grep -h "moe_experts:" $OUT_T/masked.txt $OUT_T/contig.txt
PDLAB_CONFIG_DIR=$OUT_T/configs timeout 60 python3 -m pdlab.bench.moe_experts --shapes decode --experts 64 --hidden 7168 --inter 2048 --decode-tokens 1,16,64 \
  --layouts masked,contiguous --payloads bf16 --runners triton --weights-layout fragment --config '{"FRAG_XASYNC":0}' --no-check --out $OUT/t/bench > $OUT/t/bench.txt 2>&1
grep -E "triton" $OUT/t/bench.txt | cut -c1-130
cd $OUT && tar czf res.tgz t tune && rm -rf tune t/bench
