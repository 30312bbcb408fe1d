# run on the device machine from the repository root at 65439a5 ($OUT: the folder whose files came back); the tree of
# 047ad77 (before the block list; bench/results and docs left out) carried as .old.tgz
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PYTHONPATH
P="python3 -m pip install -q --no-deps --no-build-isolation -e"; R=$OUT/r3; mkdir -p $R/before $R/after /tmp/old
tar xzf .old.tgz -C /tmp/old
PERF="python3 -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --device cuda --batch-sizes 1,4,32 \
  --context 8192 --steps 20 --ttft-lens '' --kv-dtype bf16"
(cd /tmp/old && $P . && export PDLAB_COMMIT=047ad77 && eval timeout 120 $PERF --out $R/before/perf > $R/before/perf.txt 2>&1)
$P .; export PDLAB_COMMIT=65439a5
eval timeout 120 $PERF --out $R/after/perf > $R/after/perf.txt 2>&1
timeout 170 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1
