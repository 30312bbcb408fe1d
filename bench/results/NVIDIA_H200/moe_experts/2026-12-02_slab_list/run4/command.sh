# run on the device machine from the repository root, tree of d6bb200 ($OUT: the folder whose files came back)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; export PDLAB_COMMIT=d6bb200; R=$OUT/r4; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py 2>&1 | tail -6 > $R/tests_frag_gpu.txt
for E in 256 64; do for S in 0 256; do
  timeout 50 python3 bench/gpu/sparse_experts.py --experts $E --tokens 1,4,16 --slab-rows $S --unbounded \
    --config '{"FRAG_BM": 0}' --config '{"FRAG_BM": 0, "FRAG_SLAB_LIST": 0}' >> $R/sparse.jsonl 2>&1
done; done
timeout 120 python3 -m pdlab bench moe --dispatch nvfp4 --mode both --out $R/bench_moe > $R/bench_moe.txt 2>&1
