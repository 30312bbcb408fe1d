"""Per-kernel timing (and an ncu target) for the two decode hot spots: the NVFP4 expert GEMMs at EP4
decode shapes (gate_up+SiLU and down timed apart) and MLA decode over an fp8 / bf16 cache.

    python3 bench/gpu/profile_decode.py --what moe --out DIR          # CSV of per-GEMM timings per config
    python3 bench/gpu/profile_decode.py --what moe --once             # each kernel once (for ncu)
    python3 bench/gpu/profile_decode.py --what frag --config '{"x_async": 1}'   # the fragment-order GEMMs
    ncu --clock-control none -k regex:_moe_nvfp4_gemm --launch-skip 2 --launch-count 2 \
        python3 bench/gpu/profile_decode.py --what moe --once

GPU only. Weight GB/s counts NVFP4 bytes (0.5625 B/param) of the GEMM's own weights.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser


def _time_us(fn, args) -> float | None:
    """Median µs of fn() (CUDA graph of 10 calls), or None after 3 plain calls under --once (for ncu)."""
    from pdlab.bench.harness import bench

    if args.once:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return None
    return bench(fn, cuda_graph=True, graph_calls=10, repeats=args.repeats, warmup=2).median_ms * 1e3


def _moe(args) -> list[dict]:
    from pdlab.bench.moe_experts import NVFP4_BYTES_PER_PARAM, make_layout, random_nvfp4_weights
    from pdlab.moe.runners.triton_nvfp4 import _DEFAULT, _packed, resolve_config
    from pdlab.moe.triton.nvfp4_moe import A_FLOAT, moe_nvfp4_gemm

    E, H, I = args.experts, 7168, 2048
    dev = torch.device("cuda")
    w = random_nvfp4_weights(E, H, I, dev, with_bf16=False)
    rows = []
    configs = [json.loads(c) for c in args.config] or [{}]
    for m in args.tokens:
        layout = make_layout("masked", "bf16", E, m, H, dev, torch.ones(1, device=dev))
        x, counts = layout.hidden, layout.masked_m
        h = torch.empty(E, m, I, dtype=torch.bfloat16, device=dev)
        out = torch.empty(E, m, H, dtype=torch.bfloat16, device=dev)
        for raw in configs:
            cfg = resolve_config({**_DEFAULT, **raw}, m, False)
            pw = _packed(w, cfg.get("TILED"))
            def gate_up(c=cfg, pw=pw):
                moe_nvfp4_gemm(x, A_FLOAT, None, None, pw["w13"], pw["w13_sf"], pw["w13_s2"], h, counts, None,
                               masked=True, n=I, k=H, fuse_silu=True, mma_dtype=torch.float16, cfg=c)

            def down(c=cfg, pw=pw):
                moe_nvfp4_gemm(h, A_FLOAT, None, None, pw["w2"], pw["w2_sf"], pw["w2_s2"], out, counts, None,
                               masked=True, n=H, k=I, fuse_silu=False, mma_dtype=torch.float16, cfg=c)

            stages = {"gate_up": (gate_up, 2 * I * H), "down": (down, H * I)}
            for name, (fn, params) in stages.items():
                us = _time_us(fn, args)
                if us is None:
                    continue
                rows.append({"what": "moe", "stage": name, "tokens_per_expert": m, "config": json.dumps(raw),
                             "median_us": round(us, 1), "weight_gbps": round(E * params * NVFP4_BYTES_PER_PARAM / us / 1e3, 1)})
                print(rows[-1], flush=True)
    return rows


def _ring_options(raw: dict, ring_key: str) -> dict:
    """`frag_gemm`'s x_ring / mma_async from a --what frag config, for a GEMM with a ring (raw[ring_key] ≥ 2)."""
    ring = int(raw.get(ring_key, 0)) > 0
    return {"x_ring": ring and bool(raw.get("x_ring", 0)), "mma_async": ring and bool(raw.get("mma_async", 0))}


def _frag(args) -> list[dict]:
    """The fragment-order GEMMs (moe/triton/nvfp4_frag.py) stage by stage on a masked bf16 slab: the activation
    pre-kernel, gate_up+SiLU, down. Configs: {"block_m": 16, "unroll_down": 2, "x_async": 0, "w_stages_gate": 0,
    "w_stages_down": 0, "maxnreg_gate": null, "maxnreg_down": null, "prep_gather": 0, "prep_block": null,
    "pair_down": 0, "x_ring": 0, "mma_async": 0} keys (missing: the values shown; `frag_gemm`'s w_stages / maxnreg /
    pair_n / x_ring / mma_async (these two for the GEMMs with a ring),
    `prepare_activations`' permute_in_registers = not prep_gather and block). Rows: prep, gate_up, down, the two
    GEMMs in sequence ("gemms") and all three ("layer"); with --events also each kernel's time within the sequence
    (CUDA events, eager)."""
    from pdlab.bench.moe_experts import NVFP4_BYTES_PER_PARAM, make_layout, random_nvfp4_weights
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag, program_tokens
    from pdlab.moe.triton import nvfp4_frag as F

    E, H, I = args.experts, 7168, 2048
    dev = torch.device("cuda")
    w = random_nvfp4_weights(E, H, I, dev, with_bf16=False).frag_()
    packs = _repack_frag(w)
    rows = []
    configs = [json.loads(c) for c in args.config] or [{}]
    for m in args.tokens:
        layout = make_layout("masked", "bf16", E, m, H, dev, torch.ones(1, device=dev))
        counts = layout.masked_m
        xp = F.prepare_activations(layout.hidden, counts)
        h = torch.empty(E, m, I, dtype=torch.float16, device=dev)
        out = torch.empty(E, m, H, dtype=torch.bfloat16, device=dev)
        for raw in configs:
            bm = int(raw.get("block_m", program_tokens(m)))
            xa = bool(raw.get("x_async", 0))

            def gate_up(bm=bm, xa=xa, raw=raw):
                F.frag_gemm(xp, packs["w13"], packs["w13_sf"], packs["w13_s2"], h, counts, n_out=I, fuse_silu=True,
                            block_m=bm, unroll=int(raw.get("unroll_gate", 1)), x_async=xa,
                            w_stages=int(raw.get("w_stages_gate", 0)), maxnreg=raw.get("maxnreg_gate"),
                            **_ring_options(raw, "w_stages_gate"))

            def down(bm=bm, xa=xa, raw=raw):
                F.frag_gemm(h, packs["w2"], packs["w2_sf"], packs["w2_s2"], out, counts, n_out=H, fuse_silu=False,
                            block_m=bm, unroll=int(raw.get("unroll_down", 2)), x_async=xa,
                            w_stages=int(raw.get("w_stages_down", 0)), maxnreg=raw.get("maxnreg_down"),
                            pair_n=bool(raw.get("pair_down", 0)), **_ring_options(raw, "w_stages_down"))

            def prep(raw=raw):
                F.prepare_activations(layout.hidden, counts, permute_in_registers=not raw.get("prep_gather", 0),
                                      block=raw.get("prep_block"))

            def layer():
                prep()
                gate_up()
                down()

            def gemms():
                gate_up()
                down()

            stages = {"prep": (prep, 0), "gate_up": (gate_up, 2 * I * H), "down": (down, H * I),
                      "gemms": (gemms, 3 * I * H), "layer": (layer, 3 * I * H)}  # the two GEMMs, all three
            for name, (fn, params) in stages.items():
                us = _time_us(fn, args)
                if us is None:
                    continue
                rows.append({"what": "frag", "stage": name, "tokens_per_expert": m, "config": json.dumps(raw),
                             "median_us": round(us, 1),
                             "weight_gbps": round(E * params * NVFP4_BYTES_PER_PARAM / us / 1e3, 1)})
                print(rows[-1], flush=True)
            if args.events:
                for name, us in _sequence_events([("prep", prep), ("gate_up", gate_up), ("down", down)]).items():
                    rows.append({"what": "frag", "stage": f"in_sequence:{name}", "tokens_per_expert": m,
                                 "config": json.dumps(raw), "median_us": round(us, 1)})
                    print(rows[-1], flush=True)
    return rows


def _sequence_events(steps, iters: int = 40) -> dict:
    """Median µs of each step while the steps run back to back (eager, a CUDA event between steps): where a
    sequence spends more than its steps timed alone."""
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)] for _ in range(iters)]
    for _ in range(3):
        for _, fn in steps:
            fn()
    for ev in events:
        ev[0].record()
        for i, (_, fn) in enumerate(steps):
            fn()
            ev[i + 1].record()
    torch.cuda.synchronize()
    return {name: statistics.median(ev[i].elapsed_time(ev[i + 1]) * 1e3 for ev in events)
            for i, (name, _) in enumerate(steps)}


def _mla(args) -> list[dict]:
    from pdlab.attention import ops
    from pdlab.attention.workloads import decode_problem

    from pdlab.bench.attention import parse_configs
    rows = []
    # "default" → the backend default ({} overrides nothing), "tuned" → the store's entry for the shape (ops'
    # lookup, config None), JSON → that dict merged over the default
    configs = [(text, {} if c == "default" else c) for text, c in zip(args.config, parse_configs(args.config))] \
        or [("tuned", None)]
    for kv in args.kv_dtype:
        p = decode_problem([args.seqlen] * args.batch, args.heads, 1, 64, torch.bfloat16, kv_dtype=kv,
                           device="cuda", seed=0)
        for label, cfg in configs:
            fn = lambda c=cfg: ops.mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale,  # noqa: E731
                                              kv_scale=p.kv_scale, backend="triton", config=c)
            try:
                us = _time_us(fn, args)
            except ValueError as exc:  # a config the GPU cannot run (e.g. too much shared memory): say so, go on
                rows.append({"what": "mla", "kv": kv, "heads": args.heads, "config": label, "error": str(exc)})
                print(rows[-1], flush=True)
                continue
            if us is None:
                continue
            nbytes = args.batch * args.seqlen * 576 * (1 if kv == "fp8" else 2)
            rows.append({"what": "mla", "kv": kv, "heads": args.heads, "config": label,
                         "median_us": round(us, 1), "kv_gbps": round(nbytes / us / 1e3, 1)})
            print(rows[-1], flush=True)
    return rows


def _compiled_kernels() -> list[dict]:
    """Registers, spills, shared memory and constexprs of every compiled variant of the MLA decode kernel, in
    compile order (best effort: the cache's layout is Triton's own)."""
    from pdlab.attention import triton_kernels as tk

    out = []
    try:
        names = tk._mla_fwd.arg_names
        for caches in tk._mla_fwd.device_caches.values():
            for kern in caches[0].values():
                consts = getattr(getattr(kern, "src", None), "constants", {}) or {}
                named = {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): str(v)
                         for k, v in consts.items()}
                out.append({"n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None),
                            "shared": getattr(kern.metadata, "shared", None),
                            "num_warps": getattr(kern.metadata, "num_warps", None),
                            "num_stages": getattr(kern.metadata, "num_stages", None),
                            "constexprs": {k: v for k, v in named.items() if k.isupper()}})
    except Exception as exc:  # noqa: BLE001  (diagnostics only)
        out.append({"error": repr(exc)})
    return out


def main(argv=None) -> int:
    ap = arg_parser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", choices=["moe", "frag", "mla"], required=True)
    ap.add_argument("--config", action="append", default=[],
                    help="repeatable: JSON config merged over the default, or for mla 'default' / 'tuned' "
                         "(default: moe {}, mla tuned)")
    ap.add_argument("--config-file", type=Path, help="one JSON config per line (added to --config)")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--kv-dtype", type=lambda s: s.split(","), default=["fp8"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--events", action="store_true",
                    help="frag: also time each kernel within the prep → gate_up → down sequence (CUDA events)")
    ap.add_argument("--once", action="store_true", help="run each kernel 3 times, no timing (for ncu)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.config_file:
        args.config += [ln for ln in args.config_file.read_text().splitlines() if ln.strip()]
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = {"moe": _moe, "frag": _frag, "mla": _mla}[args.what](args)
    if args.out and rows:
        import pandas as pd
        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out / f"profile_{args.what}.csv", index=False)
        if args.what == "mla":
            (args.out / "kernels_mla.json").write_text(json.dumps(_compiled_kernels(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
