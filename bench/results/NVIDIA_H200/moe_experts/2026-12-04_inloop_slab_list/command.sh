# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0. Tree: commit b60f9d9 (tests: e6a1b59). Preamble: the device
# wheels installed and put on PYTHONPATH, pdlab installed editable.
python3 bench/gpu/sparse_experts.py --weights tiled --tokens 1,4,16 --slab-rows 256 --unbounded > sparse_tiled.jsonl
# at b60f9d9; the 10 failures are the tiled-weights equality test without FRAG 0, fixed in e6a1b59
python3 -m pytest -q -rs -p no:cacheprovider tests/moe/test_triton_nvfp4_fast.py tests/moe/test_runners.py > tests_b60f9d9.txt
# at e6a1b59
python3 -m pytest -q -rs -p no:cacheprovider -m gpu --durations=10 tests/moe > moe_gpu.txt
python3 -m pytest -q -rs -p no:cacheprovider -m "not gpu" tests/moe/test_triton_nvfp4_fast.py > inloop_unmarked_on_gpu.txt
# at 3d8d28c (the kernels as at b60f9d9): slabs at or near full occupancy, list (max_rows = 8·T) against the grid
for spec in "64 8" "512 32" "2048 96"; do set -- $spec
  python3 bench/gpu/sparse_experts.py --weights tiled --tokens $1 --slab-rows $2 --unbounded
done > full_slab_tiled.jsonl
