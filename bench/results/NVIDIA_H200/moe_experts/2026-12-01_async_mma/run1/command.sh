set -u
R=$OUT; mkdir -p $R
. bench/gpu/provenance.sh; record_provenance $R
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe/test_frag.py -k "ring or pdl" > $R/pytest_frag.txt 2>&1; echo rc=$? >> $R/pytest_frag.txt; tail -3 $R/pytest_frag.txt
P="python3 bench/gpu/profile_decode.py --what frag --tokens 1,16,64"
timeout 150 $P --config '{"w_stages_gate": 2, "x_ring": 1, "w_stages_down": 2, "pair_down": 1}' \
  --config '{"w_stages_gate": 2, "x_ring": 1, "w_stages_down": 2, "pair_down": 1, "mma_async": 1}' \
  --config '{"w_stages_gate": 3, "x_ring": 1, "w_stages_down": 3, "pair_down": 1, "mma_async": 1}' \
  --config '{"w_stages_gate": 2, "x_ring": 1, "w_stages_down": 2, "pair_down": 0, "mma_async": 1}' \
  --out $R/prof > $R/prof.txt 2>&1; echo rc=$? >> $R/prof.txt; grep -v "^{" $R/prof.txt | tail -3; grep "'stage': 'gate_up'\|'stage': 'down'\|'stage': 'layer'" $R/prof.txt | sed "s/'what': 'frag', //" | cut -c1-220
for i in 1 2; do
timeout 130 python3 -m pdlab.bench.moe_experts --shapes decode --decode-tokens 1,16,64 --layouts masked,contiguous --payloads bf16,nvfp4 --runners triton,torch_grouped --weights-layout fragment --config '{"FRAG_MMA_ASYNC": 0}' --config '{"FRAG_MMA_ASYNC": 1}' --out $R/ab$i > $R/ab$i.txt 2>&1; echo rc=$? >> $R/ab$i.txt; tail -1 $R/ab$i.txt
done
tar czf $OUT/r34.tgz -C $R .
