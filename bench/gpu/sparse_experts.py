"""The experts stage when few experts get tokens (EP1 decode: T tokens × top-8 of 256 experts), per fragment-GEMM
config: CUDA-graph and eager (CUDA events) median µs and the host's time per call, contiguous rows and masked slabs
(`--slab-rows` rows per expert, default T; "masked" carries the rows bound a dispatcher gives, T·top-k, as
`max_rows`, "masked_unbounded" does not); --profile adds a torch.profiler table per config. `--weights tiled`
stores the experts tiled (`ExpertWeights.tile_()`) instead of in fragment order: the in-loop Triton kernel runs them.

    python3 bench/gpu/sparse_experts.py --tokens 1,16 --config '{}' --config '{"FRAG_RING": 0, "FRAG_PAIR_DOWN": 0}'
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pdlab._subcommands import arg_parser


def main() -> None:
    from pdlab.bench.harness import bench
    from pdlab.bench.moe_experts import random_nvfp4_weights
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import Contiguous, Masked

    ap = arg_parser()
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--slab-rows", type=int, default=0, help="rows per expert of the masked slab (0: T)")
    ap.add_argument("--unbounded", action="store_true", help="also the masked slab without max_rows")
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler table per config (contiguous)")
    ap.add_argument("--weights", choices=("frag", "tiled"), default="frag",
                    help="fragment order (the fragment GEMMs) or tiled (the in-loop kernel)")
    args = ap.parse_args()
    E, H, I, dev = args.experts, 7168, 2048, torch.device("cuda")
    w = random_nvfp4_weights(E, H, I, dev, with_bf16=False)
    w = w.frag_() if args.weights == "frag" else w.tile_()
    g = torch.Generator().manual_seed(0)
    for T in map(int, args.tokens.split(",")):
        ids = torch.stack([torch.randperm(E, generator=g)[:args.top_k] for _ in range(T)]).reshape(-1)
        counts = torch.bincount(ids, minlength=E).to(torch.int32)
        rows = int(counts.sum())
        x = torch.randn(rows, H, device=dev).to(torch.bfloat16)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0).int()]).to(dev)
        contiguous = Contiguous(x, counts.to(dev), offsets)
        slab = torch.zeros(E, args.slab_rows or max(T, 1), H, device=dev, dtype=torch.bfloat16)
        masked = Masked(slab, counts.to(dev), max_rows=T * args.top_k)
        cases = [("contiguous", contiguous), ("masked", masked)]
        if args.unbounded:
            cases.append(("masked_unbounded", Masked(slab, counts.to(dev))))
        expected, active = max(1, -(-T * args.top_k // E)), T * args.top_k
        for raw in args.config or ["{}"]:
            cfg = json.loads(raw)
            for name, layout in cases:
                def fn(layout=layout, cfg=cfg):
                    return run_experts(layout, w, runner="triton", config=cfg or None, expected_m=expected,
                                       active_experts=active)

                graph = bench(fn, cuda_graph=True, graph_calls=10, repeats=20, warmup=2).median_ms * 1e3
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
                host = []
                for a, b in ev:
                    a.record()
                    t0 = time.perf_counter()
                    fn()
                    host.append(time.perf_counter() - t0)
                    b.record()
                torch.cuda.synchronize()
                eager = statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)
                print(json.dumps({"tokens": T, "active_experts": int((counts > 0).sum()), "layout": name,
                                  "slab_rows": slab.shape[1], "experts": E, "weights": args.weights,
                                  "config": raw, "graph_us": round(graph, 1), "eager_us": round(eager, 1),
                                  "host_us": round(statistics.median(host) * 1e6, 1)}), flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for raw in args.config or ["{}"]:
                cfg = json.loads(raw)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        run_experts(contiguous, w, runner="triton", config=cfg or None, expected_m=expected,
                                    active_experts=active)
                    torch.cuda.synchronize()
                print(f"== tokens {T} contiguous config {raw}")
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14), flush=True)


if __name__ == "__main__":
    main()
