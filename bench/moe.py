"""`bench moe`: the MoE layer stage by stage — route, quantize, dispatch, experts, combine — at
DeepSeek-R1 shapes (256 experts, top-8, hidden 7168, intermediate 2048, groups 8/4) by default.

    bench moe --dispatch nvfp4                      # one GPU: local dispatch, best runner
    bench moe --ep 2 --dispatcher nccl --dispatch bf16,fp8,nvfp4 --mode normal --tokens 4096
    bench moe --ep 4 --mode both --tokens 4096 --ll-tokens 128

`--ep N` starts N ranks itself (NCCL, one GPU each; gloo on a CPU machine). Each rank holds
E/N experts of the same seeded random NVFP4 weights and its own `tokens` tokens. Per row: median
time of each stage and of the whole forward (the slowest rank's, under EP), bytes this rank sent
in dispatch and got back in combine, their GB/s, expert TFLOPS and % of roofline (weight bytes
the runner streams + activations), and the cosine error of the layer output against a plain torch
MoE over the same routing (fp32, dequantised weights, unquantised activations). Writes CSV/JSON,
a stacked-bar plot of the stages, and the nvfp4/fp8 vs bf16 (dispatch + combine) time ratios — for the
low-latency paths that never sync the host (local, nccl with the fixed exchange) also timed as a CUDA
graph (`dispatch_combine_graph_ms`), which is what a captured decode step pays, and so are the experts on their
masked slab (`experts_graph_ms`: eager, a decode-sized call measures the host's launches).
On a CPU machine it runs a small shape with the reference backends and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from pdlab._subcommands import comma_list, int_arg, list_items, one_of, positive_int
from pdlab.bench._args import add_no_plot, file_stem, out_dir_problem, seconds
from pdlab.kernels.nvfp4 import nvfp4_size_problem
from pdlab._subcommands import arg_parser

STAGES = ("route", "quantize", "dispatch", "experts", "combine")
# the CSV's columns, whatever ran (a skipped row leaves its measurements empty; so does --no-reference its cos_err)
COLUMNS = ("mode", "tokens", "payload", "runner", "ep", "dispatcher", "status", "dispatch_config",
           "dispatch_config_detail", *[f"{s}_ms" for s in STAGES], "total_ms", "dispatch_combine_graph_ms",
           "experts_graph_ms", "timing", "dispatch_MB", "combine_MB", "dispatch_GBps", "combine_GBps", "comm_GBps",
           "pairs", "tflops", "experts_GBps", "pct_roofline", "compute_peak", "cos_err")
# the low-latency buffer's tokens per rank where no low-latency row sizes it (the MoE layer's own default)
N_MAX_DEFAULT = 128
CPU_CFG = dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, n_group=4, topk_group=2,
               routed_scaling_factor=2.5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dispatch", default="nvfp4", type=comma_list(one_of("nvfp4", "fp8", "bf16"), "payloads among "
                   "nvfp4, fp8, bf16"), help="payload(s) sent in dispatch: nvfp4,fp8,bf16 (comma list)")
    p.add_argument("--runner", default="auto", type=comma_list(str, "runner names, e.g. triton,torch, or auto"),
                   help="expert runner(s): triton,torch_grouped,cutedsl,torch or auto (best usable per payload)")
    p.add_argument("--ep", type=int_arg(1), default=1, help="expert-parallel ranks to start (one GPU each)")
    p.add_argument("--dispatcher", default=None,
                   help="local | nccl | deepep (default: local for --ep 1, nccl otherwise)")
    p.add_argument("--tokens", default=None, type=comma_list(positive_int, "token counts >= 1, e.g. 1,16,128"),
                   help="tokens per rank (default 1,16,128,4096 on GPU; 1,16,64 on CPU)")
    p.add_argument("--ll-tokens", default=None, type=comma_list(positive_int, "token counts >= 1, e.g. 1,16,128"),
                   help="tokens per rank in low-latency mode (default: the --tokens values up to 256)")
    p.add_argument("--mode", default="both", choices=["normal", "low_latency", "both"])
    p.add_argument("--model", default="deepseek-r1", help="deepseek-r1 or a path to an HF DeepseekV3 / DeepseekV2 "
                   "config.json (its scoring_func, topk_method, norm_topk_prob and routed_scaling_factor route "
                   "the tokens)")
    p.add_argument("--num-max-dispatch-tokens", type=int_arg(1), default=None,
                   help="low-latency buffer tokens per rank (default: the largest low-latency token count); "
                        f"with --mode normal only {N_MAX_DEFAULT}, as no row uses it")
    p.add_argument("--repeats", type=int_arg(1), default=None, help="timed calls per stage (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int_arg(0), default=3)
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference (error column empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default bench/results/<device>/moe, or moe_ep for "
                   "--ep > 1 and --scaling)")
    p.add_argument("--name", default=None, type=file_stem, help="result file stem (default moe_ep<N>)")
    add_no_plot(p)
    p.add_argument("--timeout", type=seconds, default=1800.0, help="seconds before spawned ranks are stopped")
    p.add_argument("--scaling", nargs="+", default=None, metavar="CSV",
                   help="instead of running: plot dispatch/combine time and GB/s against the EP size from result "
                        "CSVs of earlier runs (e.g. moe_ep2_*.csv moe_ep4_*.csv moe_ep8_*.csv)")
    p.add_argument("--profile", action="store_true",
                   help="also write a torch.profiler table (CPU + CUDA) of dispatch and combine per configuration")


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from pdlab.bench import report

    if args.scaling:  # the EP sizes compared: the EP runs' folder
        return plot_scaling(args.scaling, args.out or report.default_out_dir("moe_ep"), args.name or "moe_ep_scaling",
                            plot=not args.no_plot)

    from pdlab.kernels import arch
    from pdlab.moe.config import PRESETS, MoEConfig, resolve_model
    from pdlab.moe.dispatch.base import payload_size_problem
    from pdlab.moe.dispatch.spawn import run_ranks

    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    if cuda and args.ep > ngpu:
        print(f"bench moe: --ep {args.ep} needs {args.ep} GPUs; this machine has {ngpu}")
        return 2
    dispatcher = args.dispatcher or ("local" if args.ep == 1 else "nccl")
    if dispatcher == "local" and args.ep > 1:
        print("bench moe: the local dispatcher moves no tokens between ranks; use --dispatcher nccl or deepep with --ep > 1")
        return 2
    import pdlab.moe.dispatch  # noqa: F401  (registers the dispatchers)
    import pdlab.moe.experts  # noqa: F401  (registers the runners)
    from pdlab.kernels import registry

    if args.ll_tokens is not None and args.mode == "normal":  # it would be ignored: say so
        print("bench moe: --ll-tokens sets the low-latency rows; this run is --mode normal (drop --ll-tokens, or use "
              "--mode low_latency or both)")
        return 2
    if args.num_max_dispatch_tokens not in (None, N_MAX_DEFAULT) and args.mode == "normal":  # ignored likewise
        print("bench moe: --num-max-dispatch-tokens sizes the low-latency buffer; this run is --mode normal (drop "
              "--num-max-dispatch-tokens, or use --mode low_latency or both)")
        return 2
    runners = list_items(args.runner)  # a name twice runs once
    for op, names in (("moe_experts", [r for r in runners if r != "auto"]), ("moe_dispatch", [dispatcher])):
        problem = registry.unknown_names(op, names)
        if problem:
            print(f"bench moe: {problem}")
            return 2
    if args.model.lower() in PRESETS and not os.path.exists(args.model):  # a name in any case, as tune takes it
        args.model = args.model.lower()
    try:
        _check_config_file(args.model, PRESETS)
        cfg = resolve_model(args.model)
        problem = nvfp4_size_problem(cfg.hidden_size, cfg.intermediate_size)
        if problem:
            raise ValueError(problem)
    except (OSError, ValueError) as exc:  # a missing file, not JSON, not a DeepseekV3 MoE config
        kind = "not a JSON config file: " if isinstance(exc, json.JSONDecodeError) else ""
        print(f"bench moe: --model {args.model!r}: {kind}{exc}")
        return 2
    note = ""
    if not cuda and args.model in PRESETS:  # a config file given on purpose is used as it is
        cfg = MoEConfig(**CPU_CFG)
        note = (f"CPU machine: small shape (E={cfg.num_experts}, top-{cfg.top_k}, H={cfg.hidden_size}, "
                f"I={cfg.intermediate_size}) with the reference backends (torch runner, gloo ranks); "
                "times are CPU times, not GPU figures")
        print(note)
    payloads = list_items(args.dispatch)
    for payload in payloads:  # every row of that payload would fail at run time
        problem = payload_size_problem(payload, cfg.hidden_size)
        if problem:
            print(f"bench moe: --dispatch {payload} cannot carry the model's tokens: {problem}; drop {payload} "
                  "from --dispatch, or use a model whose hidden size fits")
            return 2
    if cfg.num_experts % args.ep:
        print(f"bench moe: --ep {args.ep} does not divide the model's {cfg.num_experts} experts; choose an EP size "
              "that divides it")
        return 2
    tokens = list_items(args.tokens, int) or ([1, 16, 128, 4096] if cuda else [1, 16, 64])
    # low-latency buffers hold few tokens per rank (DeepEP allows <= 1024, recommends < 256): by default
    # the low-latency rows take the token counts up to 256
    ll_tokens = list_items(args.ll_tokens, int) or [t for t in tokens if t <= 256] or tokens[:1]
    modes = ["normal", "low_latency"] if args.mode == "both" else [args.mode]
    if not cuda:  # auto is the reference runner on CPU
        runners = list(dict.fromkeys("torch" if r == "auto" else r for r in runners))
    n_max = args.num_max_dispatch_tokens or (max(ll_tokens) if "low_latency" in modes else N_MAX_DEFAULT)
    if "low_latency" in modes and n_max < max(ll_tokens):  # every such row would fail on the buffer
        print(f"bench moe: --num-max-dispatch-tokens {n_max} is below the {max(ll_tokens)} tokens per rank of the "
              f"low-latency rows (--ll-tokens, else --tokens up to 256); give at least {max(ll_tokens)}")
        return 2
    out_dir = args.out or report.default_out_dir("moe_ep" if args.ep > 1 else "moe")
    problem = out_dir_problem(out_dir)
    if problem:
        print(f"bench moe: --out {problem}; give a folder to write the results into")
        return 2
    plan = dict(cfg=asdict(cfg), tokens=tokens, ll_tokens=ll_tokens, modes=modes, payloads=payloads, runners=runners,
                dispatcher=dispatcher, n_max=n_max, repeats=args.repeats or (20 if cuda else 5), warmup=args.warmup,
                reference=not args.no_reference, seed=args.seed, ep=args.ep, profile=args.profile)
    _print_availability(dispatcher, runners)
    t0 = time.time()
    if args.ep == 1 and dispatcher == "local":
        rows = bench_rank(0, 1, plan=plan)
    else:
        try:
            per_rank = run_ranks(bench_rank, args.ep, kwargs={"plan": plan},
                                 backend="nccl" if cuda else "gloo", timeout_s=args.timeout)
        except TimeoutError as exc:  # the ranks are stopped; no rows to write
            print(f"bench moe: {exc} (--timeout {args.timeout:g}); give a larger --timeout or fewer --tokens")
            return 1
        rows = _merge_ranks(per_rank)
    profiles = [(r, r.pop("profile_text")) for r in rows if "profile_text" in r]
    df = pd.DataFrame(rows).drop(columns="rank", errors="ignore")  # EP > 1 rows are merged over the ranks
    df = df.reindex(columns=[*COLUMNS, *[c for c in df.columns if c not in COLUMNS]])
    facts = arch.device_facts()
    name = args.name or f"moe_ep{args.ep}"
    if profiles:
        from pathlib import Path

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(f"== {r['mode']} {r['tokens']} tok/rank {r['payload']} {r['runner']} (rank 0): "
                            f"dispatch + combine, 3 calls ==\n{t}" for r, t in profiles)
        (Path(out_dir) / f"{name}_profile.txt").write_text(text)
    ratios = _ratios(df)
    meta = report.provenance(facts, {"plan": plan, "note": note, "wall_s": round(time.time() - t0, 1),
                                     "dispatch_combine_ratio_vs_bf16": ratios})
    csv = report.save(df, out_dir, name, meta)
    ok = df[df["status"] == "ok"] if "status" in df else df
    cols = ["mode", "tokens", "payload", "runner", *[f"{s}_ms" for s in STAGES], "total_ms",
            "dispatch_combine_graph_ms", "experts_graph_ms", "dispatch_MB", "combine_MB", "comm_GBps", "tflops",
            "pct_roofline", "cos_err", "dispatch_config"]
    report.print_table(ok, f"bench moe — {facts.name}, EP{args.ep}, dispatcher {dispatcher}",
                       [c for c in cols if c in ok and (ok[c].notna().any() or c in cols[:4])])  # no empty column
    skipped = df[df["status"] != "ok"] if "status" in df else df.iloc[:0]
    for _, r in skipped.iterrows():
        print(f"  skipped {r['mode']} t{r['tokens']} {r['payload']} {r['runner']}: {r['status']}")
    if ratios:
        pd.DataFrame(ratios).to_csv(csv.with_name(f"{name}_ratios.csv"), index=False)
        for r in ratios:
            print(f"  {r['mode']:<11} {r['tokens']:>5} tok/rank: {r['payload']} dispatch+combine "
                  f"{r['payload_ms']:.3f} ms vs bf16 {r['bf16_ms']:.3f} ms → ratio {r['ratio']:.2f}"
                  + (f"; in a CUDA graph {r['graph_payload_ms']:.3f} vs {r['graph_bf16_ms']:.3f} ms → "
                     f"{r['graph_ratio']:.2f}" if "graph_ratio" in r else ""))
    if not args.no_plot and len(ok):
        ok = ok.assign(config=[f"{m[:2]} t{t} {p} {r}" for m, t, p, r in
                               zip(ok["mode"], ok["tokens"], ok["payload"], ok["runner"])])
        report.plot_stacked(ok, "config", [f"{s}_ms" for s in STAGES], csv.with_name(f"{name}_stages.png"),
                            f"MoE layer stages, EP{args.ep} {dispatcher} ({facts.name})", "ms (median)")
    print(f"wrote {csv}")
    if not len(ok):
        print("bench moe: no configuration ran (every row skipped, reasons above)")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# one rank


def bench_rank(rank: int, world: int, *, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """All rows of the plan on this rank (spawnable: module level). Returns this rank's rows."""
    import torch.distributed as dist

    from pdlab.bench.harness import bench, cosine_error
    from pdlab.bench.report import progress
    from pdlab.bench.roofline import roofline
    from pdlab.kernels.arch import device_facts
    from pdlab.moe.config import MoEConfig
    from pdlab.moe.layer import MoELayer, moe_reference

    cfg = MoEConfig(**plan["cfg"])
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    facts = device_facts(dev)  # the CPU's have no peaks: no roofline
    distributed = dist.is_initialized()
    weights, gate, bias = synthetic_moe(cfg, plan["seed"], dev)
    bias = bias if cfg.topk_method == "noaux_tc" else None  # DeepSeek-V2's softmax routings take no bias
    jobs = [(mode, t, p, r) for mode in plan["modes"]
            for t in (plan["tokens"] if mode == "normal" else plan["ll_tokens"])
            for p in plan["payloads"] for r in plan["runners"]]
    rows: list[dict[str, Any]] = []
    refs: dict[int, tuple] = {}
    bar = progress(len(jobs), f"bench moe rank {rank}") if rank == 0 else contextlib.nullcontext(lambda *_: None)
    with bar as advance:
        for mode, T, payload, runner in jobs:
            row = dict(mode=mode, tokens=T, payload=payload, runner=runner, ep=world, dispatcher=plan["dispatcher"],
                       rank=rank, status="ok")
            try:
                layer = MoELayer(cfg, weights, gate, bias, None, plan["dispatcher"], None if runner == "auto" else runner,
                                 mode, payload=payload, num_max_dispatch_tokens_per_rank=plan["n_max"])
            except (ValueError, RuntimeError, KeyError) as exc:  # a pairing that cannot run: same on every rank
                rows.append({**row, "status": str(exc)})
                advance(f"skip {mode} {T} {payload}")
                continue
            row["runner"] = layer.runners[mode]
            if any((r["mode"], r["tokens"], r["payload"], r["runner"]) == (mode, T, payload, row["runner"])
                   for r in rows):  # auto picked a runner also named: measured once (every rank picks the same)
                advance(f"{mode} {T} {payload} {row['runner']} again")
                continue
            try:
                rows.append(_measure(layer, row, plan, cfg, weights, dev, facts, distributed, refs))
            except Exception as exc:  # noqa: BLE001  (a kernel failing on one configuration; recorded)
                if distributed and not isinstance(exc, (RuntimeError, ValueError, TypeError)):
                    raise
                rows.append({**row, "status": f"error: {type(exc).__name__}: {exc}"[:400]})
            del layer
            advance(f"{mode} {T} {payload} {row['runner']}")
    return rows


def _measure(layer, row, plan, cfg, weights, dev, facts, distributed, refs) -> dict:
    """Time each stage of one configuration on this rank; returns the filled row."""
    from pdlab.bench.harness import bench, cosine_error
    from pdlab.bench.roofline import roofline
    from pdlab.moe.layer import moe_reference

    T = row["tokens"]
    x = _tokens(plan["seed"], row["rank"], T, cfg.hidden_size, dev)
    ids, w = layer.route(x)
    tokens = layer.quantize(x)
    layout, handle = layer.dispatch(tokens, ids, w)
    y = layer.experts(layout, num_tokens=T)  # as the layer's forward calls it (expected rows per expert)
    out = layer.combine(y, handle)
    # which dispatcher config ran: "tuned" (the store's entry for this shape), "default" or "explicit"
    row.update(dispatch_config=handle.config_source.split(":")[0],
               dispatch_config_detail=f"{handle.config_source} {dict(handle.config)}")
    pairs = int((layout.counts if layout.kind == "contiguous" else layout.masked_m).sum())
    active = int(((layout.counts if layout.kind == "contiguous" else layout.masked_m) > 0).sum())
    kw = dict(device=dev, warmup=plan["warmup"], repeats=plan["repeats"],
              max_seconds=1e9 if distributed else 10.0)  # same call count on every rank
    times = {
        "route": bench(lambda: layer.route(x), **kw),
        "quantize": bench(lambda: layer.quantize(x), **kw),
        "dispatch": bench(lambda: layer.dispatch(tokens, ids, w), **kw),
        "experts": bench(lambda: layer.experts(layout, num_tokens=T), **kw),
        "combine": bench(lambda: layer.combine(y, handle), **kw),
        "total": bench(lambda: layer(x), **kw),
    }
    if dev.type == "cuda" and _graph_safe(layer.dispatchers.get(row["mode"])):
        # decode captures dispatch + combine in a CUDA graph: this is the time that remains there
        times["dispatch_combine_graph"] = bench(lambda: layer.combine(y, layer.dispatch(tokens, ids, w)[1]),
                                                cuda_graph=True, graph_calls=5, **kw)
        if layout.kind == "masked":  # the experts on the slab, as the captured step runs them (eager: host-bound)
            times["experts_graph"] = bench(lambda: layer.experts(layout, num_tokens=T), cuda_graph=True,
                                           graph_calls=5, **kw)
    for s, t in times.items():
        row[f"{s}_ms"] = t.median_ms
    row["timing"] = times["total"].kind
    comm_s = times["dispatch"].seconds + times["combine"].seconds
    row.update(dispatch_MB=handle.bytes_sent / 1e6, combine_MB=handle.bytes_back / 1e6,
               dispatch_GBps=handle.bytes_sent / times["dispatch"].seconds / 1e9,
               combine_GBps=handle.bytes_back / times["combine"].seconds / 1e9,
               comm_GBps=(handle.bytes_sent + handle.bytes_back) / comm_s / 1e9, pairs=pairs)
    flops = pairs * cfg.flops_per_token_expert
    wbytes = active * 3 * cfg.hidden_size * cfg.intermediate_size * _weight_bytes_per_param(row["runner"])
    abytes = pairs * cfg.hidden_size * 2 * 2
    rl = roofline(flops, wbytes + abytes, times["experts"].seconds, facts, _compute_dtype(row["runner"]))
    row.update(tflops=rl["tflops"], experts_GBps=rl["gbps"], pct_roofline=rl["pct_roofline"],
               compute_peak=rl["compute_peak"])
    if plan.get("profile"):
        row["profile_text"] = _profile(lambda: layer.combine(y, layer.dispatch(tokens, ids, w)[1]), dev)
    if plan["reference"]:
        if T not in refs:
            refs[T] = (moe_reference(x, ids, w, weights, 0, "nvfp4"),)
        row["cos_err"] = cosine_error(out.float(), refs[T][0])
    return row


def _graph_safe(dispatcher) -> bool:
    """Dispatch + combine of this dispatcher never sync the host, so they can be timed as a CUDA graph:
    the low-latency modes of `local` and of `nccl` with the fixed exchange (both tested under
    sync-debug mode and graph capture on H200s)."""
    if dispatcher is None or dispatcher.mode != "low_latency":
        return False
    if dispatcher.name == "local":
        return True
    return dispatcher.name == "nccl" and dispatcher.config.get("ll_exchange") == "fixed"


# ---------------------------------------------------------------------------------------------
# inputs


_WEIGHTS: dict[tuple, tuple] = {}


def synthetic_moe(cfg, seed: int, device: torch.device, chunk: int = 8):
    """Seeded random experts (N(0, 1/fan_in)) quantized to NVFP4 the modelopt way, + gate [E, H] and
    correction bias [E]. Built in chunks of experts on `device` with the reference quantizer
    and cached per process (a few seconds on a GPU at DeepSeek-R1 size, so no disk cache): every rank
    builds the same full set (its slice runs, the rest serves
    the reference). Returns (ExpertWeights (nvfp4 only), gate fp32, bias fp32)."""
    from pdlab.kernels import nvfp4
    from pdlab.moe.weights import ExpertWeights

    key = (seed, cfg, str(device))
    if key in _WEIGHTS:
        return _WEIGHTS[key]
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator(device=device)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("w13", "s13", "g13", "w2", "s2", "g2")}
    for e0 in range(0, E, chunk):
        n = min(chunk, E - e0)
        g.manual_seed(seed * 1000003 + e0)
        w13 = (torch.randn(n, 2 * I, H, generator=g, device=device) * H ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(n, H, I, generator=g, device=device) * I ** -0.5).to(torch.bfloat16)
        for w, (kq, ks, kg) in ((w13, ("w13", "s13", "g13")), (w2, ("w2", "s2", "g2"))):
            gs = nvfp4.global_scale_from_amax(w.float().abs().amax(dim=(1, 2))).to(device)
            packed, sf = nvfp4.quantize_nvfp4(w, gs)  # the reference, in torch ops on `device`
            parts[kq].append(packed)
            parts[ks].append(sf)
            parts[kg].append(1.0 / gs)
        del w13, w2
    cat = {k: torch.cat(v) for k, v in parts.items()}
    weights = ExpertWeights(E, H, I, w13_weight=cat["w13"], w13_weight_scale=cat["s13"], w13_weight_scale_2=cat["g13"],
                            w2_weight=cat["w2"], w2_weight_scale=cat["s2"], w2_weight_scale_2=cat["g2"],
                            w13_input_scale=torch.full((E,), 8.0 / (6 * 448), device=device),
                            w2_input_scale=torch.full((E,), 8.0 / (6 * 448), device=device))
    g.manual_seed(seed * 1000003 + E + 1)
    gate = torch.randn(E, H, generator=g, device=device) * H ** -0.5
    bias = torch.randn(E, generator=g, device=device) * 0.05
    _WEIGHTS[key] = (weights, gate, bias)
    return _WEIGHTS[key]


def _profile(fn, dev: torch.device, calls: int = 3) -> str:
    """torch.profiler table (sorted by CPU total) of `calls` calls of fn."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)


def _tokens(seed: int, rank: int, T: int, H: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank * 104729 + T)
    return torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)


def _runner_options(runner: str) -> dict:
    """The registry options of a moe_experts runner ({} for a name nobody registered)."""
    from pdlab.kernels import registry

    try:
        return registry.get_backend("moe_experts", runner).options
    except KeyError:
        return {}


def _weight_bytes_per_param(runner: str) -> float:
    """Weight bytes a runner streams per parameter: NVFP4 (0.5 + 1/16 scale) or bf16."""
    return 0.5625 if _runner_options(runner).get("weights", ("bf16",)) == ("nvfp4",) else 2.0


def _compute_dtype(runner: str) -> str:
    """The units a runner's expert GEMMs run on (the roofline's compute peak): its `compute` option (the fp32
    reference "fp32", cutedsl's NVFP4 operands "fp4"), else bf16 (triton W4A16, torch_grouped)."""
    return _runner_options(runner).get("compute", "bf16")


# ---------------------------------------------------------------------------------------------
# reporting helpers


# DeepEP's published EP8 figures (ANCHORS.md): normal mode on H800 NVLink, GB/s per rank;
# low-latency over NVLink P2P on H20 (fp8 dispatch, bf16 combine), microseconds.
DEEPEP_EP8 = {"normal": {"dispatch_GBps": 153.0, "combine_GBps": 158.0},
              "low_latency": {"dispatch_us": 37.0, "combine_us": 59.0}}


def plot_scaling(paths: list[str], out_dir: str, name: str, plot: bool = True) -> int:
    """Dispatch + combine against the EP size, one line per (mode, payload), from result CSVs: `<name>.png` (unless
    not `plot`) and the rows it drew, `<name>.csv`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from pathlib import Path

    problem = out_dir_problem(out_dir)
    if problem:
        print(f"bench moe --scaling: --out {problem}; give a folder to write the plot into")
        return 2
    need = ["ep", "mode", "tokens", "payload", "dispatch_ms", "combine_ms", "dispatch_GBps", "combine_GBps"]
    frames = []
    for p in paths:
        try:
            frame = pd.read_csv(p)
        except (OSError, ValueError) as exc:  # missing, unreadable, not CSV (pandas' ParserError is a ValueError)
            why = " ".join(str(exc).split())  # pandas' parser errors span lines
            print(f"bench moe --scaling: cannot read {p}: {why}; give result CSVs of bench moe (moe_ep<N>.csv)")
            return 2
        missing = [c for c in need if c not in frame]
        if missing:
            print(f"bench moe --scaling: {p} has no column {', '.join(missing)}: not a result CSV of bench moe "
                  "(moe_ep<N>.csv)")
            return 2
        frames.append(frame)
    df = pd.concat(frames, ignore_index=True)
    if "status" in df:
        df = df[df.status == "ok"]
    if df.empty:
        print("bench moe --scaling: no successful rows in", ", ".join(paths))
        return 1
    df = df.assign(comm_ms=df.dispatch_ms + df.combine_ms)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df[need].sort_values(["mode", "payload", "ep"]).to_csv(out / f"{name}.csv", index=False)
    summary = f"({len(df)} rows, EP sizes {sorted(df.ep.unique().tolist())}); DeepEP EP8 published: {DEEPEP_EP8}"
    if not plot:
        print(f"wrote {out / (name + '.csv')} {summary}")
        return 0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (mode, payload, tokens), grp in df.groupby(["mode", "payload", "tokens"]):
        grp = grp.groupby("ep", as_index=False)[["comm_ms", "dispatch_GBps", "combine_GBps"]].min()
        label = f"{mode} {tokens} tok/rank {payload}"
        axes[0].plot(grp.ep, grp.comm_ms, marker="o", label=label)
        axes[1].plot(grp.ep, grp.dispatch_GBps, marker="o", label=f"{label} dispatch")
    axes[1].axhline(DEEPEP_EP8["normal"]["dispatch_GBps"], color="gray", linestyle="--",
                    label="DeepEP EP8 normal dispatch (H800, published)")
    axes[0].set(xlabel="EP ranks", ylabel="dispatch + combine ms (median, slowest rank)", title="time")
    axes[1].set(xlabel="EP ranks", ylabel="dispatch GB/s per rank", title="bandwidth")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / (name + '.png')} and {out / (name + '.csv')} {summary}")
    return 0


_MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")


def _check_config_file(model: str, presets) -> None:
    """ValueError naming the problem when `model` is a path that does not exist, or a config file (or its folder)
    that is JSON but not an object whose MoE sizes are numbers (a JSON array, a null field): `MoEConfig.from_hf`
    would raise a bare TypeError."""
    if model in presets:
        return
    if not os.path.exists(model):
        if os.sep in model or model.endswith(".json"):  # a path, not a misspelt preset name
            raise ValueError(f"no such file or folder; give an HF config.json (or its model folder), or one of "
                             f"{', '.join(presets)}")
        return  # resolve_model's own error names the presets
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        return
    with open(path) as f:
        data = json.load(f)  # JSONDecodeError: reported as "not a JSON config file"
    if not isinstance(data, dict):
        raise ValueError(f"holds a JSON {type(data).__name__}, not a JSON object of a DeepseekV3-style config")
    def number(value) -> bool:
        try:
            return not isinstance(value, bool) and float(value) == float(value)
        except (TypeError, ValueError):
            return False

    optional = ("n_group", "topk_group", "n_shared_experts", "routed_scaling_factor")
    bad = [k for k in _MOE_FIELDS if k in data and not number(data[k])]
    bad += [k for k in optional if data.get(k) is not None and not number(data[k])]
    if bad:
        raise ValueError("fields that must be numbers are not: " + ", ".join(f"{k}={data[k]!r}" for k in bad))


def _merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per configuration: times = the slowest rank's, bytes = the largest rank's, dispatch / combine
    rates recomputed from those, expert rates (tflops, experts_GBps, pct_roofline) = the lowest rank's,
    error = the worst rank's."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])  # rank 0's profile_text, if any, stays
        row.pop("rank", None)
        row["status"] = next((r["status"] for r in rows if r["status"] != "ok"), "ok")
        if row["status"] == "ok":
            for k in list(row):
                if k.endswith("_ms") or k.endswith("_MB") or k in ("cos_err", "pairs"):
                    row[k] = max(r[k] for r in rows)
            comm = (row["dispatch_ms"] + row["combine_ms"]) / 1e3
            row["dispatch_GBps"] = row["dispatch_MB"] / 1e3 / (row["dispatch_ms"] / 1e3)
            row["combine_GBps"] = row["combine_MB"] / 1e3 / (row["combine_ms"] / 1e3)
            row["comm_GBps"] = (row["dispatch_MB"] + row["combine_MB"]) / 1e3 / comm
            for k in ("tflops", "experts_GBps", "pct_roofline"):  # each rank's own work over its own time
                row[k] = min(r[k] for r in rows)
        merged.append(row)
    return merged


def _ratios(df) -> list[dict]:
    """(dispatch + combine) time of each quantized payload vs bf16, per mode and token count."""
    if "status" not in df or not len(df):
        return []
    ok = df[df["status"] == "ok"]
    out = []
    for (mode, T), grp in ok.groupby(["mode", "tokens"]):
        comm = (grp["dispatch_ms"] + grp["combine_ms"]).groupby(grp["payload"]).min()
        graph = (grp["dispatch_combine_graph_ms"].groupby(grp["payload"]).min()
                 if "dispatch_combine_graph_ms" in grp and grp["dispatch_combine_graph_ms"].notna().all() else None)
        if "bf16" not in comm:
            continue
        for payload, ms in comm.items():
            if payload != "bf16":
                r = {"mode": mode, "tokens": int(T), "payload": payload, "payload_ms": float(ms),
                     "bf16_ms": float(comm["bf16"]), "ratio": float(ms / comm["bf16"])}
                if graph is not None:  # the same pair of stages replayed from a CUDA graph
                    r.update(graph_payload_ms=float(graph[payload]), graph_bf16_ms=float(graph["bf16"]),
                             graph_ratio=float(graph[payload] / graph["bf16"]))
                out.append(r)
    return out


def _print_availability(dispatcher: str, runners: list[str]) -> None:
    from pdlab.kernels import registry  # (the backends are registered by `run`'s imports)

    for row in registry.matrix():
        if row["op"] in ("moe_dispatch", "moe_experts") and not row["available"]:
            print(f"  unavailable here: {row['op']}[{row['backend']}]: {row['reason']}")


if __name__ == "__main__":
    import sys

    parser = arg_parser(prog="bench moe", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
