"""Focused benchmark of the MoE expert runners (op `moe_experts`) at EP decode and prefill shapes.

    python -m pdlab.bench.moe_experts --shapes decode,prefill --runners triton,torch_grouped \
        [--experts 64 --hidden 7168 --inter 2048] [--sweep] [--out DIR]

Per row: runner, layout, payload, tokens per expert, median/p10/p90 µs, weight GB/s (NVFP4 weights
count 0.5625 B/param, bf16 2 B/param), % of the measured HBM copy bandwidth, TFLOPS, speed-up over
torch_grouped at the same shape, cosine error against the torch fp32 reference on the same
(dequantised) weights, and which config ran (tuned / default / sweep). CSV + JSON + plots.
`make_problem` / `time_runner` are reused by `tune moe` and `bench moe`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pdlab._subcommands import comma_list, int_arg, list_items, one_of, positive_int
from pdlab.bench._args import json_object, nvfp4_size, out_dir_problem
from pdlab.bench.harness import bench, cosine_error
from pdlab.bench.roofline import roofline
from pdlab.kernels import registry
from pdlab.kernels.arch import device_facts
from pdlab.moe.experts import OP, resolved_config, run_experts
from pdlab.moe.layouts import PAYLOADS, Contiguous, Masked, quantize_payload
from pdlab.moe.runners.triton_nvfp4 import kernel_path
from pdlab.moe.weights import ExpertWeights
from pdlab._subcommands import arg_parser

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (512, 1024, 2048)
NVFP4_BYTES_PER_PARAM = 0.5625
EXTRA_ROWS = ("sweep", "explicit")  # config sources of the extra triton rows (--sweep, --config): not the baseline


@dataclass
class Problem:
    weights: ExpertWeights
    layouts: dict  # (layout, payload) -> layout object
    m: int


def random_nvfp4_weights(E: int, H: int, I: int, device, with_bf16: bool = True, seed: int = 0) -> ExpertWeights:
    """Random NVFP4 experts (bytes uniform, block scales in [0.5, 4], weight_scale_2 0.01 → |w| ≤ 0.24),
    plus the identical values in bf16 for the bf16 baseline. Built directly: quantising 3 GB of bf16
    with the reference quantizer would dominate the benchmark."""
    g = torch.Generator(device=device).manual_seed(seed)

    def fp4(n, k):
        return torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device=device, generator=g)

    def sf(n, k):
        return (0.5 + 3.5 * torch.rand((E, n, k // 16), device=device, generator=g)).to(torch.float8_e4m3fn)

    w = ExpertWeights(E, H, I)
    w.w13_weight, w.w13_weight_scale = fp4(2 * I, H), sf(2 * I, H)
    w.w2_weight, w.w2_weight_scale = fp4(H, I), sf(H, I)
    w.w13_weight_scale_2 = torch.full((E,), 0.01, device=device)
    w.w2_weight_scale_2 = torch.full((E,), 0.01, device=device)
    w.w13_input_scale = torch.full((E,), 4.0 / 2688, device=device)
    w.w2_input_scale = torch.full((E,), 4.0 / 2688, device=device)
    if with_bf16:
        w13, w2 = w.dequantized(torch.bfloat16)
        w.w13, w.w2 = w13, w2
    return w


def make_layout(kind: str, payload: str, E: int, m: int, H: int, device, global_scale: torch.Tensor,
                seed: int = 1):
    """m tokens for each of E experts, as a Masked [E, m, H] or Contiguous [E·m, H] layout."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((E * m, H), device=device, generator=g).to(torch.bfloat16)
    hidden, scales, gs = quantize_payload(x, payload, global_scale if payload == "nvfp4" else None)
    counts = torch.full((E,), m, dtype=torch.int32, device=device)
    if kind == "contiguous":
        offsets = torch.arange(0, E * m + 1, m, dtype=torch.int32, device=device)
        return Contiguous(hidden, counts, offsets, payload, scales, gs)
    return Masked(hidden.view(E, m, -1), counts, payload, None if scales is None else scales.view(E, m, -1), gs)


def expert_flops(E: int, m: int, H: int, I: int) -> float:
    return 2.0 * E * m * 3 * H * I


def weight_bytes(E: int, H: int, I: int, form: str) -> float:
    return E * 3 * H * I * (NVFP4_BYTES_PER_PARAM if form == "nvfp4" else 2.0)


def time_runner(layout, weights, runner: str, config: dict | None = None, expected_m: int | None = None,
                repeats: int = 30):
    """Timing of one run_experts call (CUDA graph of 10 calls when it captures, plain events otherwise)."""
    fn = lambda: run_experts(layout, weights, runner=runner, config=config, expected_m=expected_m)  # noqa: E731
    fn()
    big = (expected_m or 1) > 256
    calls, repeats = (2, min(repeats, 8)) if big else (10, repeats)
    try:
        return bench(fn, cuda_graph=True, graph_calls=calls, repeats=repeats, warmup=2)
    except Exception:  # a runner that cannot be captured
        torch.cuda.synchronize()
        return bench(fn, repeats=repeats, warmup=2)


def valid_rows(layout_out, layout_in) -> torch.Tensor:
    """The rows of layout_out.hidden that hold tokens, [rows, K] in its dtype: a masked layout's first masked_m[e]
    rows of each expert e, a contiguous layout's first offsets[-1] rows."""
    h = layout_out.hidden
    if isinstance(layout_in, Masked):
        keep = torch.arange(h.shape[1], device=h.device)[None, :] < layout_in.masked_m.long()[:, None]
        return h[keep]
    return h[: int(layout_in.offsets[-1])]


def main(argv: list[str] | None = None) -> int:
    prog = "pdlab.bench.moe_experts"
    p = arg_parser(prog=prog, description=__doc__.split("\n")[0])
    tokens = comma_list(positive_int, "tokens per expert >= 1, e.g. 1,16,64")
    p.add_argument("--shapes", default="decode,prefill", type=comma_list(one_of("decode", "prefill"), "decode,prefill"),
                   help="phases to run: decode,prefill")
    p.add_argument("--decode-tokens", default=",".join(map(str, DECODE_TOKENS)), type=tokens)
    p.add_argument("--prefill-tokens", default="512,2048", type=tokens)
    p.add_argument("--runners", default="triton,torch_grouped", type=comma_list(str, "runner names, e.g. triton,torch"))
    p.add_argument("--layouts", default="masked,contiguous",
                   type=comma_list(one_of("masked", "contiguous"), "layouts among masked, contiguous"))
    p.add_argument("--payloads", default="bf16,nvfp4", type=comma_list(one_of(*PAYLOADS), "payloads among "
                   + ", ".join(PAYLOADS)), help="activation payloads tried where a runner accepts them")
    p.add_argument("--experts", type=int_arg(1), default=64)
    p.add_argument("--hidden", type=nvfp4_size, default=7168)
    p.add_argument("--inter", type=nvfp4_size, default=2048)
    p.add_argument("--sweep", action="store_true", help="also try a small triton config grid per shape")
    p.add_argument("--sweep-tokens", default="16,64,512", type=tokens, help="tokens per expert where --sweep applies")
    p.add_argument("--config", action="append", default=[], metavar="JSON", type=json_object,
                   help="also time the triton runner with this config (repeatable; rows marked 'explicit')")
    p.add_argument("--no-check", action="store_true", help="skip the error check against the torch reference")
    p.add_argument("--weights-layout", default="modelopt", choices=["modelopt", "tiled", "fragment"],
                   help="store the NVFP4 experts in this layout in place first, as the runtime does (fragment: its "
                        "choice on sm90; tiled: elsewhere)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import pandas as pd

    from pdlab.bench import report
    from pdlab.kernels.arch import measure_peaks, with_peaks

    if torch.cuda.is_available():
        dev = torch.device("cuda")
        peaks = measure_peaks(save=False)
        facts = with_peaks(device_facts(), peaks)
        hbm = peaks.hbm_bytes_per_s
    else:  # a CPU smoke run of the same flow (tiny shapes advised: --experts 4 --hidden 256 --inter 128)
        print("no CUDA device: timing on the CPU, no roofline")
        dev, facts, peaks, hbm = torch.device("cpu"), device_facts(), None, float("nan")
    E, H, I = args.experts, args.hidden, args.inter
    interp = dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    names = list_items(args.runners)
    problem = registry.unknown_names(OP, names)
    out = args.out or report.default_out_dir("moe_experts")
    problem = problem or (f"--out {why}; give a folder to write the results into" if (why := out_dir_problem(out))
                          else None)
    if problem:
        print(f"{prog}: {problem}")
        return 2
    runners = [r for r in names if registry.unavailable_reason(OP, r) is None
               or (interp and registry.get_backend(OP, r).options.get("interpretable"))]
    skipped = {r: registry.unavailable_reason(OP, r) for r in names if r not in runners}
    for r, why in skipped.items():
        print(f"skipping runner {r}: {why}")
    weights = random_nvfp4_weights(E, H, I, dev, with_bf16="torch_grouped" in runners)
    weights.store_(args.weights_layout)
    a_gs = weights.activation_global_scale
    shapes = []
    phases = list_items(args.shapes)
    if "decode" in phases:
        shapes += [("decode", m) for m in list_items(args.decode_tokens, int)]
    if "prefill" in phases:
        shapes += [("prefill", m) for m in list_items(args.prefill_tokens, int)]
    rows = []
    jobs = []
    for phase, m in shapes:
        for kind in list_items(args.layouts):
            for payload in list_items(args.payloads):
                for r in runners:
                    opts = registry.get_backend(OP, r).options
                    if kind in opts["layouts"] and payload in opts["payloads"]:
                        jobs.append((phase, m, kind, payload, r))
    sweep_grid = _sweep_grid() if args.sweep else {}
    with report.progress(len(jobs), "moe experts") as advance:
        for phase, m, kind, payload, r in jobs:
            layout = make_layout(kind, payload, E, m, H, dev, a_gs)
            configs = [(None, "tuned/default")]
            if (args.sweep and r == "triton" and payload == "bf16" and m in list_items(args.sweep_tokens, int)
                    and kind == ("masked" if phase == "decode" else "contiguous")):
                configs += [(c, "sweep") for c in sweep_grid.get(phase, [])]
            if r == "triton":
                configs += [(json.loads(c), "explicit") for c in args.config]
            err = float("nan")
            if not args.no_check:
                ref_layout = run_experts(layout, weights, runner="torch", config={"weights": "nvfp4"})
                run_layout = run_experts(layout, weights, runner=r, expected_m=m)
                err = cosine_error(valid_rows(run_layout, layout).float(), valid_rows(ref_layout, layout).float())
                del ref_layout, run_layout
            for cfg, source in configs:
                try:
                    t = time_runner(layout, weights, r, cfg, expected_m=m)
                except Exception as exc:  # a sweep point that does not compile / fit
                    print(f"{r} {kind} m={m} config {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                form = "nvfp4" if r in ("triton", "cutedsl") else "bf16"
                # the config run_experts resolved for this row, where it came from, and (triton) which kernels ran
                try:
                    resolved, src = resolved_config(layout, weights, r, cfg, m)
                except Exception:  # noqa: BLE001  (a store that cannot be read: the row still counts)
                    resolved, src = None, "default"
                path = kernel_path(layout, weights, resolved) if r == "triton" and resolved is not None else "-"
                rl = roofline(expert_flops(E, m, H, I), weight_bytes(E, H, I, form), t.seconds, facts)
                if source not in EXTRA_ROWS:
                    source = src if registry.get_backend(OP, r).config_space else "n/a"
                rows.append({"phase": phase, "tokens_per_expert": m, "experts": E, "hidden": H, "inter": I,
                             "layout": kind, "payload": payload, "runner": r, "path": path, "weights": form,
                             "weights_layout": weights.nvfp4_layout if form == "nvfp4" else "-",
                             "median_us": t.median_ms * 1e3, "p10_us": t.p10_ms * 1e3, "p90_us": t.p90_ms * 1e3,
                             "timing": t.kind, "weight_gbps": rl["gbps"],
                             "pct_hbm": 100 * rl["gbps"] * 1e9 / hbm,
                             "tflops": rl["tflops"], "cos_err": err, "config_source": source,
                             "config": "" if cfg is None else repr(cfg)})
            advance(f"{r} {kind}/{payload} m={m}")
            del layout
            Path(out).mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).to_csv(Path(out) / "moe_experts_partial.csv", index=False)  # survives a timeout
    df = pd.DataFrame(rows)
    if df.empty:
        print("no rows")
        return 1
    base = df[(df.runner == "torch_grouped") & ~df.config_source.isin(EXTRA_ROWS)]
    base = base.set_index(["tokens_per_expert", "layout"])
    best = df.groupby(["tokens_per_expert", "layout", "payload", "runner"], as_index=False)["median_us"].min()
    df["speedup_vs_torch_grouped"] = [
        (base.loc[(m, l), "median_us"] if (m, l) in base.index else float("nan")) / us
        for m, l, us in zip(df.tokens_per_expert, df.layout, df.median_us)]
    meta = report.provenance(facts, {"measured_hbm_gbps": hbm / 1e9,
                                     "measured_bf16_tflops": peaks.bf16_flops / 1e12 if peaks else None,
                                     "weights": "random NVFP4 bytes, scales 0.5..4, scale_2 0.01"})
    wrote = [report.save(df, out, "moe_experts", meta), report.save(best, out, "moe_experts_best", meta)]
    (Path(out) / "moe_experts_partial.csv").unlink(missing_ok=True)  # it only survives a timeout
    report.print_table(df, f"moe_experts E={E} H={H} I={I} (measured HBM {hbm / 1e9:.0f} GB/s)",
                       ["phase", "tokens_per_expert", "layout", "payload", "runner", "path", "median_us", "weight_gbps",
                        "pct_hbm", "tflops", "speedup_vs_torch_grouped", "cos_err", "config_source", "config"])
    plain = df[~df.config_source.isin(EXTRA_ROWS)].copy()
    plain["series"] = plain.runner + "/" + plain.layout + "/" + plain.payload
    for phase, y, ylabel in (("decode", "weight_gbps", "weight GB/s"), ("prefill", "tflops", "TFLOPS")):
        part = plain[plain.phase == phase]
        if not part.empty:
            wrote.append(report.plot_bars(part, "tokens_per_expert", y, "series", f"{out}/moe_experts_{phase}.png",
                             f"MoE experts {phase}, E={E} H={H} I={I}", ylabel,
                             hline=hbm / 1e9 if phase == "decode" and peaks else None,
                             hline_label="measured HBM copy GB/s" if phase == "decode" else None))
    for path in wrote:
        print(f"wrote {path}")
        if path.suffix == ".csv":  # report.save writes its JSON beside it
            print(f"wrote {path.with_suffix('.json')}")
    return 0


def _sweep_grid() -> dict[str, list[dict]]:
    # H200 sweeps so far (16 tokens/expert): BLOCK_K 128 > 256 > 512, 4 warps > 8, SPLIT_NIBBLES slower;
    # off = the integer unpack in natural K order (the committed default before DEQ_ASM / PERM_K)
    off = dict(DEQ_ASM=0, PERM_K=0)
    fast = dict(DEQ_ASM=1, PERM_K=1)
    decode = [dict(BLOCK_M=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, **off),
              dict(BLOCK_M=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, MMA_FP16=1, **off),
              dict(BLOCK_M=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DEQ_ASM=1, PERM_K=0),
              dict(BLOCK_M=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DEQ_ASM=0, PERM_K=1)]
    decode += [dict(BLOCK_M=0, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, **fast)
               for bn, bk, w, s in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 128, 4, 5),
                                    (64, 64, 4, 6), (128, 256, 8, 3), (64, 128, 4, 4, ))]
    decode[-1]["SPLIT_K"] = 2
    prefill = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, GROUP_M=8, **off)]
    prefill += [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, GROUP_M=8, **fast)
                for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
                                         (64, 128, 128, 4, 4))]
    prefill += [dict(DENSE_MIN_M=1, DENSE_CHUNK=c) for c in (8, 16, 32, 64)]
    return {"decode": decode, "prefill": prefill}


if __name__ == "__main__":
    sys.exit(main())
