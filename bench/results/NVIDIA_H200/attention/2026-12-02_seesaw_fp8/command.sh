# One H200 (sm90), torch 2.11.0+cu130, triton 3.6.0, flashinfer not on the path. Preamble: the device wheels installed
# and put on PYTHONPATH, pdlab installed editable.
#
# first_*.csv — tree: commit 67faa06 plus the new kernel as committed in cb6ed3d (attention/gluon_mla_seesaw_fp8.py),
# before the split rule (the two-warpgroup kernel then ran at every fp8 64-row launch) and with 248 registers for
# the right warpgroup (4 bytes spilled; cb6ed3d gives both 256, no spill):
python3 bench/gpu/wide_mla.py --out $OUT/r1 --fp8-only --variants '{}' '{"seesaw": 0}' --shape-set wide_fp8 --no-baseline
# crossover_timing.csv — the same tree with 256 registers, before the split rule; 4 splits forced in two variants:
python3 bench/gpu/wide_mla.py --out $OUT/r2 --skip-correctness --variants '{}' '{"seesaw": 0}' '{"num_splits": 4}' \
  '{"seesaw": 0, "num_splits": 4}' --no-baseline --shapes '128,2048,128,1,fp8;128,3072,128,1,fp8;64,2048,128,1,fp8;64,4096,128,1,fp8;32,2048,128,1,fp8;8,4096,128,1,fp8;8,16384,128,1,fp8;1,8192,128,1,fp8;1,32768,128,1,fp8;128,1024,128,1,fp8;128,8192,128,1,bf16'
python3 -m pytest -q -x -m gpu tests/attention/test_gluon_mla_wide.py tests/attention/test_gpu.py -p no:cacheprovider
# wide_correctness.csv, wide_timing.csv, wide.txt — tree: commit cb6ed3d (the split rule in), then the re-tune of
# ../../tuning/2026-12-02_seesaw_fp8_retune and the decode step of ../../runtime/2026-12-02_seesaw_fp8_step:
export PDLAB_COMMIT=cb6ed3d
timeout 200 python3 bench/gpu/wide_mla.py --out $OUT/w --fp8-only --variants '{}' '{"seesaw": 0}' --no-baseline \
  --shapes '128,1024,128,1,fp8;128,2048,128,1,fp8;128,3072,128,1,fp8;128,4096,128,1,fp8;128,8192,128,1,fp8;128,16384,128,1,fp8;64,4096,128,1,fp8;64,8192,128,1,fp8;32,8192,128,1,fp8;8,4096,128,1,fp8;8,16384,128,1,fp8;1,8192,128,1,fp8;1,32768,128,1,fp8;128,8192,128,2,fp8;128,8192,64,1,fp8;128,8192,16,4,fp8' \
  > $OUT/w/wide.txt 2>&1
