"""The 64-row Gluon MLA decode kernel (attention/gluon_mla_wide.py) on a GPU: every variant against the fp32
reference on ragged, NaN-poisoned problems, then timings at the goal shapes against `_mla_fwd`.

    python3 bench/gpu/wide_mla.py --out DIR [--quick] [--skip-correctness] [--variants '{"num_splits": 2}' ...]
                                  [--shape-set fp8_16]   # the 16-head fp8 kernel's goal shapes instead
                                  [--shape-set wide_fp8 --fp8-only]   # its fp8 shapes, each variant checked over fp8

Writes DIR/wide_correctness.csv, DIR/wide_timing.csv and prints both tables. GPU only (sm90).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser


def _problem(seqlens, heads, q_len, page, dtype, kv, seed, poison=True):
    from pdlab.attention.workloads import decode_problem

    return decode_problem(seqlens, heads, q_len=q_len, page=page, dtype=dtype,
                          kv_dtype="fp8" if kv == "fp8" else "same", device="cuda", seed=seed, poison=poison)


def _check(rows, heads, q_len, page, dtype, cfg, seqlens, seed, kv="same"):
    from pdlab.attention import mla_decode
    from pdlab.bench.harness import cosine_error

    p = _problem(seqlens, heads, q_len, page, dtype, kv, seed)
    rec = {"heads": heads, "q_len": q_len, "page": page, "dtype": str(dtype).split(".")[-1], "kv": kv,
           "config": json.dumps(cfg), "batch": len(seqlens), "max_seqlen": max(seqlens)}
    try:
        want_o, want_l = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                                    backend="torch")
        got_o, got_l = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                                  backend="triton", config=cfg)
        torch.cuda.synchronize()
        rec.update(cos_out=cosine_error(got_o, want_o), cos_lse=cosine_error(got_l, want_l),
                   nan=bool(torch.isnan(got_o).any()))
        rec["ok"] = bool(rec["cos_out"] < 1e-5 and rec["cos_lse"] < 1e-5 and not rec["nan"])
    except Exception as exc:  # a failing variant is a row, not the end of the run
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        traceback.print_exc()
    rows.append(rec)
    print(json.dumps(rec), flush=True)


def correctness(variants, quick: bool, fp8_only: bool = False) -> list[dict]:
    rows: list[dict] = []
    ragged = [1, 63, 64, 65, 127, 128, 129, 1000, 2047, 4096, 8192, 5, 777]  # raised to S_q below
    shapes = [(128, 1), (64, 1), (128, 2), (32, 2), (16, 4), (128, 4)]
    if quick:
        shapes = shapes[:3]
    seed = 0
    for cfg in [] if fp8_only else variants:
        for heads, q_len in shapes:
            for page in (64, 128):
                for splits in (0, 1, 3, 16):
                    seed += 1
                    _check(rows, heads, q_len, page, torch.bfloat16, {**cfg, "kernel": "gluon", "num_splits": splits},
                           [max(q_len, n) for n in ragged], seed)
    for cfg in variants:  # fp8 pools
        for heads, q_len in shapes:
            for page in (64, 128):
                for splits in (0, 3):
                    seed += 1
                    _check(rows, heads, q_len, page, torch.bfloat16, {**cfg, "kernel": "gluon", "num_splits": splits},
                           [max(q_len, n) for n in ragged], seed, kv="fp8")
    if fp8_only:
        return rows
    seed += 1
    _check(rows, 128, 1, 64, torch.float16, {"kernel": "gluon"}, ragged, seed)
    # the tail of a split inside the first tile, empty splits
    seed += 1
    _check(rows, 128, 1, 64, torch.bfloat16, {"kernel": "gluon", "num_splits": 64}, [1, 2, 3, 200], seed)
    return rows


# the 16-head shapes of the fp8 goal (fp8 ≥ 1.6× faster than bf16): bf16 through `_mla_fwd`, fp8 through the Gluon
# fp8 kernel (gluon_mla.py), each variant a config of it
FP8_16_SHAPES = [(128, 8192, 16, 1, "bf16"), (128, 8192, 16, 1, "fp8"), (64, 16384, 16, 1, "bf16"),
                 (64, 16384, 16, 1, "fp8"), (128, 16384, 16, 1, "bf16"), (128, 16384, 16, 1, "fp8"),
                 (32, 8192, 16, 1, "bf16"), (32, 8192, 16, 1, "fp8"), (128, 8192, 16, 2, "fp8")]


# the 64-row kernel over fp8 pools only
WIDE_FP8_SHAPES = [(128, 8192, 128, 1, "fp8"), (128, 16384, 128, 1, "fp8"), (128, 4096, 128, 1, "fp8"),
                   (128, 1024, 128, 1, "fp8"), (64, 8192, 128, 1, "fp8"), (32, 8192, 128, 1, "fp8"),
                   (8, 4096, 128, 1, "fp8"), (128, 8192, 128, 2, "fp8")]


def timing(variants, quick: bool, shape_set: str = "wide", shapes=None, baseline: bool = True) -> list[dict]:
    from pdlab.attention import mla_decode
    from pdlab.attention.workloads import decode_cost
    from pdlab.bench.harness import bench

    rows = []
    given = shapes
    shapes = [(128, 8192, 128, 1, "bf16"), (128, 8192, 128, 1, "fp8"), (128, 16384, 128, 1, "bf16"),
              (128, 4096, 128, 1, "bf16"), (128, 1024, 128, 1, "bf16"), (128, 1024, 128, 1, "fp8"),
              (64, 8192, 128, 1, "bf16"), (32, 8192, 128, 1, "bf16"), (32, 8192, 128, 1, "fp8"),
              (8, 1024, 128, 1, "bf16"), (1, 8192, 128, 1, "bf16"), (128, 8192, 128, 2, "bf16"),
              (128, 8192, 128, 2, "fp8"), (128, 8192, 64, 1, "bf16"), (128, 8192, 16, 4, "bf16")]
    if shape_set == "fp8_16":
        shapes = FP8_16_SHAPES
    elif shape_set == "wide_fp8":
        shapes = WIDE_FP8_SHAPES
    if given:
        shapes = given
    if quick:
        shapes = shapes[:2]
    for batch, seqlen, heads, q_len, kv in shapes:
        p = _problem([seqlen] * batch, heads, q_len, 64, torch.bfloat16, kv, 1, poison=False)
        flops, nbytes = decode_cost(batch, q_len, heads, p.total_kv, 1 if kv == "fp8" else 2)
        from pdlab.attention.ops import resolve_config
        from pdlab.kernels import registry

        fp8_16 = shape_set == "fp8_16"
        cands = []
        # (`_mla_fwd` over fp8 at 16 heads is the slow path the fp8 kernel replaced)
        if baseline and not (fp8_16 and kv == "fp8"):
            bucket = {"batch": batch, "seqlen": seqlen, "heads": heads, "kv_dtype": kv, "q_len": q_len}
            tuned, src = resolve_config("mla_decode", registry.get_backend("mla_decode", "triton"), bucket,
                                        torch.device("cuda"), None)
            cands += [("triton", {"kernel": "triton"}),
                      (f"triton-tuned ({src.split('/')[-1]})", {**tuned, "kernel": "triton"})]
        if not fp8_16 or kv == "fp8":
            cands += [(f"{'gluon_fp8' if fp8_16 else 'wide'} {json.dumps(v)}", {**v, "kernel": "gluon"})
                      for v in variants]
        for name, cfg in cands:
            def fn(cfg=cfg):
                mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                           backend="triton", config=cfg)
            try:
                t = bench(fn, cuda_graph=True, graph_calls=5, repeats=20, warmup=3)
                ms = t.median_ms
                rec = {"batch": batch, "seqlen": seqlen, "heads": heads, "q_len": q_len, "kv": kv, "kernel": name,
                       "ms": round(ms, 4), "p10": round(t.p10_ms, 4), "p90": round(t.p90_ms, 4),
                       "tflops": round(flops / ms / 1e9, 1), "gbps": round(nbytes / ms / 1e6, 1)}
            except Exception as exc:
                rec = {"batch": batch, "seqlen": seqlen, "heads": heads, "q_len": q_len, "kv": kv, "kernel": name,
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = arg_parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", nargs="*", default=['{}', '{"num_splits": 1}', '{"num_splits": 2}'],
                    help="configs of the wide kernel to time (JSON, merged over the default)")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--fp8-only", action="store_true", help="check only the fp8 pools, once per variant")
    ap.add_argument("--check-variants", action="store_true", help="check every variant (16-bit and fp8 pools)")
    ap.add_argument("--shapes", default="", help="timed shapes instead of the set's: 'B,S,H,Q,KV;...' "
                    "(e.g. '128,8192,128,1,fp8;64,8192,128,1,bf16')")
    ap.add_argument("--no-baseline", action="store_true", help="time the variants only (not `_mla_fwd`)")
    ap.add_argument("--shape-set", choices=["wide", "wide_fp8", "fp8_16"], default="wide",
                    help="wide: the 64-row kernel's shapes; wide_fp8: its fp8 ones only; fp8_16: the 16-head fp8 "
                         "goal's (the variants then configure the fp8 Gluon kernel, timed against the bf16 `_mla_fwd`)")
    args = ap.parse_args(argv)
    import pandas as pd

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [json.loads(v) for v in args.variants]
    ok = True
    if not args.skip_correctness:
        checked = variants if args.fp8_only or args.check_variants else [{}]
        rows = correctness(checked, args.quick, args.fp8_only)
        pd.DataFrame(rows).to_csv(out / "wide_correctness.csv", index=False)
        ok = all(r["ok"] for r in rows)
        print(f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} ok", flush=True)
    shapes = [(*map(int, x.split(",")[:4]), x.split(",")[4]) for x in args.shapes.split(";") if x]
    rows = timing(variants, args.quick, args.shape_set, shapes, not args.no_baseline)
    df = pd.DataFrame(rows)
    df.to_csv(out / ("wide_timing.csv" if args.shape_set == "wide" else f"{args.shape_set}_timing.csv"), index=False)
    print(df.to_string(index=False))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
