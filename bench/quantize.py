"""`bench quantize`: NVFP4 quantization (bf16 -> packed e2m1 + e4m3 scales) per backend and shape.

Reports time per call, GB/s counting bytes read + written, % of the device's HBM bandwidth
(measured with --measure-peaks, else cached or datasheet), and whether each backend's output is
bit-exact with the torch reference (packed bytes, row-major scales and the 128x4 swizzled scales).
Exit code 1 if any backend that ran is not bit-exact, or if none ran.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from pdlab._subcommands import comma_list, int_arg, list_items
from pdlab.bench._args import add_no_plot, nvfp4_size, out_dir_problem

GPU_M = [1, 128, 1024, 4096, 16384]
GPU_K = [7168, 2048]
CPU_M = [1, 16, 128]
CPU_K = [2048]
# the CSV's columns, whatever ran (a skipped or failed row leaves its measurements empty)
COLUMNS = ("shape", "M", "K", "E", "backend", "dtype", "config", "status", "time_us", "p10_us", "p90_us", "gbps",
           "pct_bw", "bit_exact", "timing", "bytes", "reason")
# A few launch configs tried by --sweep at M=4096, K=7168 (the tuner searches the full space).
SWEEP = [{"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w}
         for bm, bk, w in [(2, 1024, 2), (4, 512, 2), (4, 1024, 4), (8, 256, 2), (8, 512, 4), (8, 512, 8),
                           (8, 1024, 4), (16, 512, 4), (16, 512, 8), (2, 512, 1), (4, 256, 1)]]
SWEEP += [{"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "TILES_K": t}
          for bm, bk, w, t in [(4, 512, 2, 2), (4, 512, 2, 7), (2, 512, 1, 7), (4, 256, 1, 4)]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int_arg(1), nargs="+",
                   help="rows (default: 1 128 1024 4096 16384 on GPU, 1 16 128 on CPU)")
    p.add_argument("--k", type=nvfp4_size, nargs="+", help="hidden sizes (default: 7168 2048 on GPU, 2048 on CPU)")
    p.add_argument("--backends", default="torch,triton", type=comma_list(str, "backend names, e.g. torch,triton"),
                   help="comma-separated backends (default: torch,triton)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--grouped", type=str, default=None,
                   help="also run a masked grouped shape E,M_max (default on GPU: 32,256; 'none' to skip)")
    p.add_argument("--sweep", action="store_true", help="also time the triton backend over a few launch configs "
                   "(at M=4096, K=7168 on GPU; at the run's largest --m and first --k on CPU, where Triton interprets)")
    p.add_argument("--repeats", type=int_arg(1), default=50)
    p.add_argument("--measure-peaks", action="store_true",
                   help="measure this GPU's copy bandwidth and bf16 rate first (cached for later runs)")
    p.add_argument("--out", default=None, help="results folder (default: bench/results/<device>/quantize)")
    add_no_plot(p)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from pdlab.bench import report
    from pdlab.kernels import arch, nvfp4, registry

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    facts = arch.device_facts()
    if args.measure_peaks and not cuda:  # it would be ignored: say so rather than measure without it
        print("bench quantize: --measure-peaks measures a CUDA GPU's copy bandwidth and bf16 rate; this machine has "
              "none (drop --measure-peaks)")
        return 2
    if args.measure_peaks:
        facts = arch.with_peaks(facts, arch.measure_peaks())
    peak_bw = facts.peaks.hbm_bytes_per_s if facts.peaks else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ms = list(dict.fromkeys(args.m or (GPU_M if cuda else CPU_M)))
    ks = list(dict.fromkeys(args.k or (GPU_K if cuda else CPU_K)))
    grouped = args.grouped if args.grouped is not None else ("32,256" if cuda else "4,16")
    cases = [(m, k, None) for k in ks for m in ms]
    if grouped and grouped != "none":
        try:
            e, m_max = (int(v) for v in grouped.split(","))
        except ValueError:
            print(f"bench quantize: --grouped takes E,M_max (e.g. 32,256) or none, not {grouped!r}")
            return 2
        if e < 1 or m_max < 1:
            print(f"bench quantize: --grouped {grouped}: E and M_max must be >= 1 (e.g. 32,256), or none to skip")
            return 2
        cases.append((m_max, ks[0], e))
    names = list_items(args.backends)  # a name twice runs once
    problem = registry.unknown_names("nvfp4_quantize", names)
    if problem:
        print(f"bench quantize: {problem}")
        return 2
    out_dir = args.out or report.default_out_dir("quantize")
    problem = out_dir_problem(out_dir)
    if problem:
        print(f"bench quantize: --out {problem}; give a folder to write the results into")
        return 2
    if args.sweep and "triton" not in names:  # the sweep times triton: rows the user left out would appear
        print(f"bench quantize: --sweep times the triton backend's launch configs; --backends {args.backends} "
              "leaves it out (add triton, or drop --sweep)")
        return 2
    jobs = [(case, name, None) for case in cases for name in names]
    if args.sweep:
        # the interpreter takes minutes per call at R1's [4096, 7168]: hours for the sweep; on CPU the run's own shape
        sweep_shape = (4096, 7168, None) if cuda else (max(ms), ks[0], None)
        jobs += [(sweep_shape, "triton", cfg) for cfg in SWEEP]

    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows, ref_cache = [], {}
    with report.progress(len(jobs), f"nvfp4 quantize on {facts.name}") as advance:
        for (m, k, e), name, cfg in jobs:
            label = f"[{e}, {m}, {k}] masked" if e else f"[{m}, {k}]"
            row = {"shape": label, "M": m, "K": k, "E": e or 0, "backend": name, "dtype": args.dtype,
                   "config": _cfg_text(cfg)}
            reason = _reason(registry, name)
            if reason:
                rows.append(row | {"status": "skipped", "reason": reason})
                advance(f"{name} {label}: skipped")
                continue
            key = (m, k, e)
            if key not in ref_cache:
                ref_cache[key] = _inputs_and_reference(nvfp4, m, k, e, dtype, device, gen)
            x, gs, masked_m, ref = ref_cache[key]
            try:
                out = nvfp4.quantize(x, gs, masked_m, backend=name, config=cfg)
                out_sw = nvfp4.quantize(x, gs, masked_m, backend=name, config=cfg, swizzle=True)
                exact = (torch.equal(out[0], ref[0]) and torch.equal(out[1].view(torch.uint8), ref[1])
                         and torch.equal(out_sw[1].view(torch.uint8), ref[2]))
                timing = _time(lambda: nvfp4.quantize(x, gs, masked_m, backend=name, config=cfg),
                               device, args.repeats)
            except Exception as exc:  # a config that fails to compile is a result, not a crash
                rows.append(row | {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"})
                advance(f"{name} {label}: error")
                continue
            live_rows = int(masked_m.sum()) if masked_m is not None else m
            nbytes = live_rows * k * x.element_size() + (x.numel() // k) * (k // 2 + k // 16)
            gbps = nbytes / timing.seconds / 1e9
            row |= {"status": "ok", "time_us": timing.median_ms * 1e3, "p10_us": timing.p10_ms * 1e3,
                    "p90_us": timing.p90_ms * 1e3, "gbps": gbps,
                    "pct_bw": 100 * gbps * 1e9 / peak_bw if peak_bw else float("nan"),
                    "bit_exact": "ref" if registry.get_backend(nvfp4.QUANTIZE.name, name).reference else exact,
                    "timing": timing.kind, "bytes": nbytes}
            rows.append(row)
            advance(f"{name} {label}: {timing.median_ms * 1e3:.1f} us")

    df = pd.DataFrame(rows, columns=COLUMNS)
    meta = report.provenance(facts, {"peak_bw_bytes_per_s": peak_bw, "dtype": args.dtype,
                                     "bytes": "read x (live rows) + write packed K/2 + scales K/16 per row"})
    path = report.save(df, out_dir, "quantize", meta)
    cols = [c for c in ["shape", "backend", "config", "status", "time_us", "gbps", "pct_bw", "bit_exact", "timing"]
            if df[c].notna().any() or c in ("shape", "backend", "config", "status")]  # no empty column
    bw_note = (f"pct_bw = % of {peak_bw / 1e12:.2f} TB/s ({facts.peaks.source})" if peak_bw
               else "no bandwidth figure: no pct_bw")
    kind = "CPU timings (perf_counter)" if not cuda else "CUDA-event timings, L2 flushed"
    report.print_table(df, f"NVFP4 quantize on {facts.name}, {kind}; {bw_note}", cols)
    if "reason" in df:
        for (backend, status), reason in df.dropna(subset=["reason"]).groupby(["backend", "status"])["reason"]:
            print(f"{backend} {status}: {'; '.join(sorted(set(reason)))}")
    ok = df[df["status"] == "ok"]
    if not args.no_plot and len(ok):
        report.plot_bars(ok[ok["config"] == "default"], "shape", "gbps", "backend", path.with_suffix(".png"),
                         f"NVFP4 quantize ({args.dtype}) on {facts.name}", "GB/s (read + write)",
                         hline=peak_bw / 1e9 if peak_bw else None, hline_label="HBM bandwidth")
    ran = sorted(set(ok["backend"])) if len(ok) else []
    print(f"backends that ran: {', '.join(ran) or 'none'}; results in {path.parent}")
    if not ran:
        print("bench quantize: no backend ran (reasons above)")
        return 1
    bad = ok[ok["bit_exact"].astype(str) == "False"] if len(ok) else ok
    if len(bad):
        print(f"NOT bit-exact vs the torch reference: {', '.join(sorted(set(bad['backend'] + ' ' + bad['shape'])))}")
        return 1
    return 0


def _reason(registry, name: str) -> str | None:
    try:
        return registry.unavailable_reason("nvfp4_quantize", name)
    except KeyError as exc:
        return str(exc)


def _cfg_text(cfg: dict | None) -> str:
    if not cfg:
        return "default"
    text = f"{cfg['BLOCK_M']}x{cfg['BLOCK_K']} w{cfg['num_warps']}"
    return text + (f" t{cfg['TILES_K']}" if cfg.get("TILES_K", 1) > 1 else "")


def _inputs_and_reference(nvfp4, m, k, e, dtype, device, gen):
    shape = (e, m, k) if e else (m, k)
    # activations with outlier channels, so block scales span a wide range
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    x = x * torch.exp(2 * torch.randn(k, generator=gen, device=device)).clamp(max=50)
    x = x.to(dtype)
    masked_m = None
    if e:
        masked_m = torch.randint(0, m + 1, (e,), generator=gen, device=device, dtype=torch.int32)
        amax = x.float().abs().amax(dim=(1, 2))
    else:
        amax = x.float().abs().amax().reshape(1)
    gs = nvfp4.global_scale_from_amax(amax).to(device)
    p, s = nvfp4.quantize(x, gs, masked_m, backend="torch")
    return x, gs, masked_m, (p, s.view(torch.uint8), nvfp4.swizzle_scales_128x4(s).view(torch.uint8))


def _time(fn, device, repeats):
    from pdlab.bench.harness import bench

    return bench(fn, device=device, warmup=5 if device.type == "cuda" else 1,
                 repeats=repeats if device.type == "cuda" else min(repeats, 10), flush_l2=True)
