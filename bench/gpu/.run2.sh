set -u
unset TRITON_INTERPRET
B="python3 -m pdlab.bench.moe_experts --shapes decode --experts 64 --hidden 7168 --inter 2048"
timeout 250 $B --decode-tokens 1,16,64,128 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped \
  --config '{"FRAG":0}' --out $OUT/as_loaded > $OUT/as_loaded.txt 2>&1; echo "rc=$?" >> $OUT/as_loaded.txt
timeout 200 $B --shapes decode,prefill --decode-tokens 1,16,64,128,256 --prefill-tokens 512,2048 --layouts masked,contiguous --payloads bf16,nvfp4 \
  --runners triton --weights-layout fragment --out $OUT/stored > $OUT/stored.txt 2>&1; echo "rc=$?" >> $OUT/stored.txt
tail -3 $OUT/as_loaded.txt $OUT/stored.txt
cd $OUT && tar czf res.tgz as_loaded stored as_loaded.txt stored.txt && rm -rf as_loaded stored
