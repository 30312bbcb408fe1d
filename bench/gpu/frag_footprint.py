"""Does a fragment GEMM slow down when more weight bytes are touched between its calls? gate_up (EP4 decode shapes,
masked bf16 slab, the runner's default ring options) timed in CUDA graphs three ways: repeated on one copy of the
experts, alternating between two copies (twice the footprint, the same work per call), and alternating with the
down GEMM of the same experts (the expert call's own sequence, without the activation kernel). Prints one JSON line
per token count; µs per gate_up call (the down GEMM's own time, timed alone, taken off in the last case).

    python3 bench/gpu/frag_footprint.py --tokens 16,64

GPU only (sm90, Triton with Gluon).
"""

from __future__ import annotations

import json

import torch

from pdlab._subcommands import arg_parser


def main() -> None:
    from pdlab.bench.harness import bench
    from pdlab.bench.moe_experts import make_layout, random_nvfp4_weights
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag, default_mma_async, program_tokens
    from pdlab.moe.triton import nvfp4_frag as F

    ap = arg_parser()
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args()
    E, H, I, dev = args.experts, 7168, 2048, torch.device("cuda")
    packs = [_repack_frag(random_nvfp4_weights(E, H, I, dev, with_bf16=False, seed=s).frag_()) for s in (0, 1)]
    for m in map(int, args.tokens.split(",")):
        layout = make_layout("masked", "bf16", E, m, H, dev, torch.ones(1, device=dev))
        counts = layout.masked_m
        xp = F.prepare_activations(layout.hidden, counts)
        h = torch.empty(E, m, I, dtype=torch.float16, device=dev)
        out = torch.empty(E, m, H, dtype=torch.bfloat16, device=dev)
        bm = program_tokens(m)
        mma_async = default_mma_async(bm, m)

        def gate_up(p):
            F.frag_gemm(xp, p["w13"], p["w13_sf"], p["w13_s2"], h, counts, n_out=I, fuse_silu=True, block_m=bm,
                        w_stages=2, x_ring=True, mma_async=mma_async)

        def down(p):
            F.frag_gemm(h, p["w2"], p["w2_sf"], p["w2_s2"], out, counts, n_out=H, fuse_silu=False, block_m=bm,
                        w_stages=2, pair_n=H % 256 == 0, x_ring=True, mma_async=mma_async)

        def timed(fn) -> float:
            return bench(fn, cuda_graph=True, graph_calls=10, repeats=20, warmup=2).median_ms * 1e3

        one = timed(lambda: gate_up(packs[0]))
        two = timed(lambda: (gate_up(packs[0]), gate_up(packs[1]))) / 2
        down_alone = timed(lambda: down(packs[0]))
        with_down = timed(lambda: (gate_up(packs[0]), down(packs[0]))) - down_alone
        print(json.dumps({"tokens_per_expert": m, "gate_up_one_copy_us": round(one, 1),
                          "gate_up_two_copies_us": round(two, 1), "gate_up_with_down_us": round(with_down, 1),
                          "down_alone_us": round(down_alone, 1)}), flush=True)


if __name__ == "__main__":
    main()
