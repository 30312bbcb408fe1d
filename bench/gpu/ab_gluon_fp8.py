"""A/B timing of versions of the fp8 Gluon MLA decode kernel (attention/gluon_mla.py) in one process, interleaved
so that clock and thermal drift fall on every version alike, with the bf16 `_mla_fwd` (tuned) as the yardstick of
the fp8 goal (fp8 ≥ 1.6× faster than bf16 at 16 heads).

    python3 bench/gpu/ab_gluon_fp8.py --out DIR NAME=PATH [NAME=cfg:JSON ...] [--rounds 5]

Each PATH is a copy of gluon_mla.py; its `launch` replaces the package's for that version's calls (selection,
splits and combine stay the package's). NAME=cfg:JSON runs the package's kernel with those decode config knobs
(e.g. cfg:{"num_splits": 4}); NAME=PATH+JSON a copy with knobs. --shapes picks uniform (BxL) and ragged batches.
Every version is first checked against the torch reference (1e-5 cosine).
Writes DIR/ab_fp8.csv (one row per shape × version × round) and prints the medians. GPU only (sm90).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser

SHAPES = "128x8192,64x16384,128x16384,32x8192"
# ragged batches (seeded): lengths uniform in a range, or one long sequence among short ones
RAGGED = {"ragged64": (64, 1024, 16384), "ragged128": (128, 512, 16384), "ragged32": (32, 256, 32768)}


def _lengths(shape: str) -> list[int]:
    """BxL (B sequences of L tokens), a RAGGED name, or longtail (one of 32768 tokens, 127 of 1024)."""
    import random

    if shape == "longtail":
        return [32768] + [1024] * 127
    if shape in RAGGED:
        b, lo, hi = RAGGED[shape]
        rng = random.Random(0)
        return [rng.randint(lo, hi) for _ in range(b)]
    b, n = shape.split("x")
    return [int(n)] * int(b)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"pdlab_ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = arg_parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=SHAPES, help=f"comma list of BxL, {', '.join(RAGGED)}, longtail")
    ap.add_argument("--profile", action="store_true",
                    help="also print each version's CUDA kernels and their times at B=128, seqlen 8192 "
                         "(torch.profiler)")
    ap.add_argument("versions", nargs="+", metavar="NAME=PATH")
    args = ap.parse_args(argv)
    import pandas as pd

    from pdlab.attention import gluon_mla, mla_decode
    from pdlab.attention.workloads import decode_cost, decode_problem
    from pdlab.bench.harness import bench, cosine_error

    real = gluon_mla.launch
    versions, knobs = {}, {}
    for v in args.versions:
        name, src = v.split("=", 1)
        if src.startswith("cfg:"):
            versions[name], knobs[name] = real, json.loads(src[4:])
        else:  # PATH, or PATH+JSON: that version with those knobs
            path, _, js = src.partition("+")
            versions[name], knobs[name] = _load(name, path).launch, json.loads(js or "{}")

    def run(p, kv, launch, name=None):
        gluon_mla.launch = launch
        try:
            # bf16: the tuned store's config
            cfg = {"kernel": "gluon", **knobs.get(name, {})} if kv == "fp8" else None
            return mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                              backend="triton", config=cfg)
        finally:
            gluon_mla.launch = real

    ok = True
    p = decode_problem([1, 63, 64, 65, 700, 3000, 4097, 129], 16, device="cuda", kv_dtype="fp8", seed=3)
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                     backend="torch")
    for name, launch in versions.items():
        o, lse = run(p, "fp8", launch, name)
        err = max(cosine_error(o, ref[0]), cosine_error(lse, ref[1]))
        ok &= err < 1e-5
        print(json.dumps({"version": name, "check_cos_err": err}), flush=True)
    if args.profile:
        _profile(versions, run)
    rows = []
    for shape in args.shapes.split(","):
        lens = _lengths(shape)
        batch = len(lens)
        probs = {kv: decode_problem(lens, 16, device="cuda", kv_dtype=kv, seed=1, poison=False)
                 for kv in ("bf16", "fp8")}
        cands = [("bf16 _mla_fwd", "bf16", real)] + [(n, "fp8", f) for n, f in versions.items()]
        for r in range(args.rounds):
            for name, kv, launch in cands:
                pr = probs[kv]
                t = bench(lambda: run(pr, kv, launch, name), cuda_graph=True, graph_calls=5, repeats=10, warmup=2)
                flops, nbytes = decode_cost(batch, 1, 16, pr.total_kv, 1 if kv == "fp8" else 2)
                rows.append({"shape": shape, "batch": batch, "tokens": sum(lens), "version": name, "round": r,
                             "ms": round(t.median_ms, 4), "gbps": round(nbytes / t.median_ms / 1e6, 1)})
        del probs
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "ab_fp8.csv", index=False)
    med = df.groupby(["shape", "version"], sort=False)["ms"].median().unstack("version")
    for name in versions:
        med[f"bf16/{name}"] = (med["bf16 _mla_fwd"] / med[name]).round(3)
    print(med.to_string())
    return 0 if ok else 1


def _profile(versions, run) -> None:
    """Per version: the kernels one fp8 decode call launches at B=128, 8k (main kernel, split combine) and their
    mean CUDA time over 20 calls."""
    from torch.profiler import ProfilerActivity, profile

    from pdlab.attention.workloads import decode_problem

    p = decode_problem([8192] * 128, 16, device="cuda", kv_dtype="fp8", seed=1, poison=False)
    for name, launch in versions.items():
        for _ in range(3):
            run(p, "fp8", launch, name)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run(p, "fp8", launch, name)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                t = getattr(ev, "device_time_total", None) or ev.cuda_time_total
                print(json.dumps({"version": name, "kernel": ev.key[:60], "calls": ev.count,
                                  "us_per_call": round(t / ev.count, 2)}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
