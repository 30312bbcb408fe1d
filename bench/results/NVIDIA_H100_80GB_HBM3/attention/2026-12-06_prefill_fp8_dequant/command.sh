# on one GPU, the tree at commit f1f3cdb (device wheels installed as the README's GPU notes say)
OUT=$OUT/dq CONFIGS='{"fp8_dequant":0}' bash bench/gpu/prefill_default.sh
python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/runtime tests/disagg tests/tuning tests/bench   # runtime_tests.txt
# small shapes again, in CUDA graphs (small_cuda_graph.csv) and eagerly (small_eager.csv)
for g in "--cuda-graph" ""; do
  python3 -m pdlab bench attention --op prefill --backend triton --batch 1,8 --new-tokens 256 --seqlen 256,768 \
    --heads 16,128 --kv-dtype fp8 --config default --config '{"fp8_dequant":0}' --repeats 20 --max-seconds 2 $g \
    --no-plot --out $OUT/g --name small$g
done
