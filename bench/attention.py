"""`bench attention`: every MLA backend on every shape in one run, against the roofline and the
torch reference.

Per row: time (median, p10/p90), TFLOPS and GB/s by FlashMLA's formulas
(FLOPs = 2·s_q·Σseqlen·h·(576+512), bytes = Σseqlen·576·kv_elem + b·s_q·h·(576+512)·q_elem, q_elem the
bytes of the q and output dtype the row ran: 4 for fp32, else 2), % of the
device roofline, the cosine error 1 - 2Σxy/Σ(x²+y²) of out and lse against the torch fp32
reference, and which config the backend ran (tuned file, default or explicit). Unavailable
backends are listed with the reason. CSV + JSON + plots go to --out (default
bench/results/<device>/attention).

    bench attention --backend triton,flashmla,torch --batch 1,32,128 --seqlen 1024,4096,16384 \\
        --heads 16,128 --kv-dtype bf16,fp8 --page-size 64 --s-q 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch

from pdlab._subcommands import comma_list, int_arg, list_items, one_of, positive_int
from pdlab.bench._args import add_no_plot, file_stem, out_dir_problem, seconds

_GPU_DEFAULTS = {"batch": "128", "seqlen": "1024,4096,8192", "heads": "16,128", "kv_dtype": "bf16,fp8",
                 "page_size": "64", "s_q": "1"}
_CPU_DEFAULTS = {"batch": "2", "seqlen": "64,200", "heads": "16", "kv_dtype": "bf16", "page_size": "16", "s_q": "1"}


KV_DTYPES = ("bf16", "fp16", "fp32", "fp8")
# per --kv-dtype: the dtype of q (and of the cache, except fp8's uint8 bytes) and the bytes per cache element
_Q_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
_KV_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0}
# the CSV's columns, whatever ran (a failed or unsupported row leaves its measurements empty)
COLUMNS = ("op", "batch", "seqlen", "heads", "kv_dtype", "page", "s_q", "shape", "backend", "status", "config_source",
           "kernel", "config", "median_ms", "p10_ms", "p90_ms", "timing", "tflops", "gbps", "pct_roofline", "bound",
           "compute_peak", "err_out", "err_lse")


def _page_size(text: str) -> int:
    value = positive_int(text)
    if value > 128 or value & (value - 1):
        raise ValueError("is not a power of two in 1..128")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", choices=("decode", "prefill"), default="decode")
    p.add_argument("--backend", default=None, type=comma_list(str, "backend names, e.g. triton,torch"),
                   help="comma list of backends (default: every backend of the op, e.g. for decode triton, flashmla, "
                        "trtllm_mla, flashinfer, torch; unavailable ones are listed with the reason)")
    p.add_argument("--batch", type=comma_list(positive_int, "batch sizes >= 1, e.g. 1,32,128"),
                   help="comma list (GPU default 128; CPU 2)")
    p.add_argument("--seqlen", type=comma_list(positive_int, "token counts >= 1, e.g. 1024,8192"),
                   help="comma list of (mean) total tokens per sequence (GPU default 1024,4096,8192)")
    p.add_argument("--heads", type=comma_list(positive_int, "head counts >= 1, e.g. 16,128"),
                   help="comma list (GPU default 16,128)")
    p.add_argument("--kv-dtype", type=comma_list(one_of(*KV_DTYPES), "cache dtypes, e.g. bf16,fp8"),
                   help="comma list of bf16|fp16|fp32|fp8 (GPU default bf16,fp8)")
    p.add_argument("--page-size", type=comma_list(_page_size, "page sizes among 1, 2, 4, ..., 128"),
                   help="comma list (default 64 on GPU)")
    p.add_argument("--s-q", type=comma_list(positive_int, "new tokens per sequence >= 1, e.g. 1,2,4"),
                   help="decode: new tokens per sequence, comma list (default 1)")
    p.add_argument("--new-tokens", type=int_arg(0, "0 (the whole sequence is new) or a count"), default=None,
                   help="prefill: new tokens per sequence (0 = the whole sequence is new)")
    p.add_argument("--varlen", action="store_true", help="seqlens drawn uniformly in [seqlen/2, 3*seqlen/2]")
    p.add_argument("--config", action="append", default=[], type=_config_word,
                   help="JSON config for tunable backends, 'default' (the backend's default even where a tuned "
                        "entry exists) or 'tuned' (the nearest tuned entry, else the default); repeatable, one row "
                        "per config; none given: tuned")
    p.add_argument("--repeats", type=int_arg(1), default=30)
    p.add_argument("--max-seconds", type=seconds, default=2.0, help="time budget per row")
    p.add_argument("--cuda-graph", action="store_true", help="time replays of a CUDA graph of calls")
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference (no error column)")
    p.add_argument("--out", help="output folder (default bench/results/<device>/attention)")
    p.add_argument("--name", default=None, type=file_stem, help="file stem (default mla_<op>)")
    p.add_argument("--seed", type=int, default=0)
    add_no_plot(p)


def parse_configs(texts: list[str]) -> list:
    """--config values → what each bench row runs: a JSON dict (explicit, merged over the default), "default"
    (the backend's default even where a tuned file has an entry) or None (the nearest tuned entry, else the
    default; also what no --config at all means)."""
    out = []
    for text in texts:
        if text in ("default", "tuned"):
            out.append(None if text == "tuned" else "default")
            continue
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"bench attention: --config {text!r} is neither JSON nor 'default'/'tuned': {exc}")
        if not isinstance(cfg, dict):
            raise SystemExit(f"bench attention: --config {text!r} must be a JSON object, 'default' or 'tuned'")
        out.append(cfg)
    return out or [None]


def _config_word(text: str) -> str:
    """An argparse `type` for one --config: what `parse_configs` takes, else the usage error (exit 2) saying why."""
    try:
        parse_configs([text])
    except SystemExit as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("bench attention: ")) from None
    return text


def run(args: argparse.Namespace) -> int:
    from pdlab.attention import mla_decode, mla_prefill
    from pdlab.attention.ops import MLA_DECODE, MLA_PREFILL, resolve_config, supports
    from pdlab.attention.workloads import decode_cost, decode_problem, prefill_cost, prefill_problem
    from pdlab.bench import report
    from pdlab.bench.harness import bench, cosine_error
    from pdlab.bench.roofline import compute_dtype, peak_lines, roofline
    from pdlab.kernels import registry
    from pdlab.kernels.arch import device_facts
    from pdlab.kernels.contracts import dtype_name

    import pandas as pd
    from pathlib import Path

    problem = out_dir_problem(args.out or report.default_out_dir("attention"))
    if problem:
        print(f"bench attention: --out {problem}; give a folder to write the results into")
        return 2
    for flag, value, op_of_flag in (("--s-q", args.s_q, "decode"), ("--new-tokens", args.new_tokens, "prefill")):
        if value is not None and args.op != op_of_flag:  # it would be ignored: say so rather than measure another shape
            print(f"bench attention: {flag} applies to --op {op_of_flag}; this run is --op {args.op} (drop {flag}, "
                  f"or add --op {op_of_flag})")
            return 2
    if args.new_tokens is None:
        args.new_tokens = 0

    cuda = torch.cuda.is_available()
    if args.cuda_graph and not cuda:  # CUDA graphs need a GPU: every row would be timed eagerly, labelled as asked
        print("bench attention: --cuda-graph times CUDA-graph replays and needs a CUDA GPU; this machine has none "
              "(drop --cuda-graph)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    defaults = _GPU_DEFAULTS if cuda else _CPU_DEFAULTS
    get = lambda name: getattr(args, name) or defaults[name]  # noqa: E731
    op = MLA_DECODE if args.op == "decode" else MLA_PREFILL
    facts = device_facts()
    configs = parse_configs(args.config)

    if args.backend is None:  # each op its own backends: prefill has no flashmla / trtllm_mla
        names = [b.name for b in registry.backends(op.name)]
    else:
        names = list_items(args.backend)
    problem = registry.unknown_names(op.name, names)
    if problem:
        print(f"bench attention: {problem}")
        return 2
    explicit = [text for text, cfg in zip(args.config, configs) if isinstance(cfg, dict)]
    if explicit and not any(registry.get_backend(op.name, n).config_space for n in names):  # it would be ignored
        tunable = [b.name for b in registry.backends(op.name) if b.config_space]
        print(f"bench attention: --config {explicit[0]!r} sets the knobs of tunable backends; --backend "
              f"{args.backend} has none with knobs (add {', '.join(tunable) or 'one that has'}, or drop --config)")
        return 2
    usable, missing = [], []
    for name in names:
        reason = registry.unavailable_reason(op.name, name)
        (missing.append((name, reason)) if reason else usable.append(name))
    for name, reason in missing:
        print(f"[unavailable] {op.name}[{name}]: {reason}")

    longest = max(list_items(get("seqlen"), int))
    if args.op == "prefill" and not args.varlen and args.new_tokens > longest:  # capped per sequence: say so
        print(f"bench attention: --new-tokens {args.new_tokens} exceeds every --seqlen (at most {longest}): those "
              "rows prefill their whole sequence (n = seqlen)")
    shapes = list(itertools.product(list_items(get("batch"), int), list_items(get("seqlen"), int),
                                    list_items(get("heads"), int), list_items(get("kv_dtype")),
                                    list_items(get("page_size"), int),
                                    list_items(get("s_q"), int) if args.op == "decode" else [args.new_tokens]))
    rows = []
    rng = random.Random(args.seed)
    total = len(shapes) * max(1, sum(len(configs) if registry.get_backend(op.name, n).config_space else 1
                                     for n in usable))
    with report.progress(total, f"bench attention {args.op}") as advance:
        for B, L, H, kv_dtype, page, sq in shapes:
            lens = [max(1, rng.randint(L // 2, L + L // 2)) for _ in range(B)] if args.varlen else [L] * B
            dtype, elem = _Q_DTYPE[kv_dtype], _KV_BYTES[kv_dtype]
            if args.op == "decode":
                lens = [max(n, sq) for n in lens]
                p = decode_problem(lens, H, sq, page, dtype, kv_dtype="fp8" if kv_dtype == "fp8" else "same",
                                   device=device, seed=rng.randrange(1 << 30))
                call = lambda backend, config: mla_decode(  # noqa: E731
                    p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                    backend=backend, config=config)
                flops, nbytes = decode_cost(B, sq, H, sum(lens), elem, dtype.itemsize)
                q_len = sq
            else:
                new = [n if sq <= 0 else min(sq, n) for n in lens]
                p = prefill_problem(lens, new, H, page, dtype, kv_dtype="fp8" if kv_dtype == "fp8" else "same",
                                    device=device, seed=rng.randrange(1 << 30))
                call = lambda backend, config: mla_prefill(  # noqa: E731
                    p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale, kv_scale=p.kv_scale,
                    max_q_len=p.max_q_len, backend=backend, config=config)
                flops, nbytes = prefill_cost(lens, new, H, elem, dtype.itemsize)
                q_len = None
            ref = None
            if not args.no_reference:
                ref = call("torch", None)
            # the lengths and new tokens as run: a sequence holds at least its S_q new tokens, a prefill adds at
            # most its length (--seqlen 2 --s-q 4 ran 4 tokens, --new-tokens 5 --seqlen 3 ran 3 new ones)
            L = L if args.varlen else lens[0]
            sq = sq if args.op == "decode" else max(new)
            base = {"op": args.op, "batch": B, "seqlen": L, "heads": H, "kv_dtype": kv_dtype, "page": page,
                    "s_q": sq, "shape": f"B{B} L{L} H{H} {kv_dtype} p{page} " + ("q" if args.op == "decode" else "n")
                    + str(sq)}
            bucket = {"batch": B, "seqlen": p.block_table.shape[1] * page, "heads": H, "kv_dtype": kv_dtype,
                      "q_len": sq if args.op == "decode" else p.max_q_len}
            for name in usable:
                b = registry.get_backend(op.name, name)
                why = supports(b, page_size=page, kv_dtype=kv_dtype, q_dtype=dtype_name(dtype), q_len=q_len,
                               arch=registry.detect_arch(device))
                for cfg in (configs if b.config_space else [None]):
                    row = dict(base, backend=name)
                    if why:
                        rows.append(dict(row, status=f"unsupported: {why}"))
                        advance(f"{name} skip")
                        continue
                    try:
                        if cfg == "default":
                            used, source = b.config(), "default"
                        else:
                            used, source = resolve_config(op.name, b, bucket, device, cfg)
                        fn = lambda: call(name, used)  # noqa: E731
                        kernel = _kernel(args.op, name, p, used)
                        out, lse = fn()
                        err_out = cosine_error(out, ref[0]) if ref is not None else float("nan")
                        err_lse = cosine_error(lse, ref[1]) if ref is not None else float("nan")
                        graph = args.cuda_graph and not b.reference
                        t = bench(fn, device=device, repeats=args.repeats, cuda_graph=graph,
                                  warmup=2 if b.reference else 5, max_seconds=args.max_seconds)
                        # q's dtype sets the units: fp32 rows run on the CUDA cores (see PEAK_LABELS); fp8 caches
                        # keep bf16 q's peak (the e4m3 q·k of some Gluon kernels runs at up to twice it)
                        peak = compute_dtype(dtype)
                        rf = roofline(flops, nbytes, t.seconds, facts, peak)
                        rows.append(dict(row, status="ok", config_source=source, kernel=kernel,
                                         config=json.dumps(used, sort_keys=True) if used else "",
                                         median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms, timing=t.kind,
                                         tflops=rf["tflops"], gbps=rf["gbps"], pct_roofline=rf["pct_roofline"],
                                         bound=rf["bound"], compute_peak=rf["compute_peak"], err_out=err_out,
                                         err_lse=err_lse))
                    except Exception as exc:  # one failing config must not end the sweep
                        rows.append(dict(row, status=f"error: {type(exc).__name__}: {str(exc)[:200]}",
                                         config=json.dumps(cfg) if cfg else ""))
                    advance(f"{base['shape']} {name}")
            del p, ref
            pd.DataFrame(rows, columns=COLUMNS).to_csv(f"{args.out or report.default_out_dir('attention')}/"
                                      f"{args.name or 'mla_' + args.op}.partial.csv", index=False)
            if cuda:
                torch.cuda.empty_cache()

    df = pd.DataFrame(rows, columns=COLUMNS)
    out_dir = args.out or report.default_out_dir("attention")
    stem = args.name or f"mla_{args.op}"
    partial = Path(out_dir) / f"{stem}.partial.csv"
    if not rows:  # no usable backend asked for: nothing measured, no empty CSV (pandas cannot read one)
        partial.unlink(missing_ok=True)
        usable_here = [b.name for b in registry.backends(op.name) if not registry.unavailable_reason(op.name, b.name)]
        print(f"bench attention: no row ran: none of the backends asked for runs on this machine (reasons above); "
              f"usable here: {', '.join(usable_here) or 'none'}")
        return 1
    meta = report.provenance(facts, {"unavailable": dict(missing), "formulas": "FlashMLA benchmark (ANCHORS.md)"})
    csv = report.save(df, out_dir, stem, meta)
    partial.unlink(missing_ok=True)  # the whole run is in the CSV now (the partial one only survives a crash)
    ok = df[df["status"] == "ok"] if "status" in df else df.iloc[0:0]
    cols = [c for c in ("shape", "backend", "kernel", "config_source", "median_ms", "p10_ms", "p90_ms", "tflops",
                        "gbps",
                        "pct_roofline", "err_out", "err_lse") if c in ok]
    if len(ok):
        report.print_table(ok, f"{op.name} on {facts.name}", cols)
    if len(ok) and not args.no_plot:
        peaks = facts.peaks
        report.plot_bars(ok.assign(label=ok["backend"] + " " + ok["config_source"].str.slice(0, 12)), "shape",
                         "tflops", "label", f"{out_dir}/{stem}_tflops.png", f"{op.name}: achieved TFLOPS",
                         "TFLOPS", hlines=peak_lines(peaks, ok["compute_peak"]))
        report.plot_bars(ok.assign(label=ok["backend"] + " " + ok["config_source"].str.slice(0, 12)), "shape",
                         "gbps", "label", f"{out_dir}/{stem}_gbps.png", f"{op.name}: achieved GB/s", "GB/s",
                         hline=peaks.hbm_bytes_per_s / 1e9 if peaks else None, hline_label="HBM peak")
    bad = df[df["status"] != "ok"] if "status" in df else df.iloc[0:0]
    for _, r in bad.iterrows():
        print(f"[{r['status']}] {r['shape']} {r['backend']} {r['config'] if pd.notna(r['config']) else ''}".rstrip())
    print(f"wrote {csv}")
    if not len(ok):
        print("bench attention: no row ran (every row failed or was unsupported, reasons above)")
        return 1
    return 0


def _kernel(op: str, backend: str, p, config) -> str:
    """The kernel a row ran: for the triton backend's decode the one its selection rule picks (a Gluon kernel on sm90
    where one fits, `_mla_fwd` otherwise), else the backend's name."""
    if op != "decode" or backend != "triton":
        return backend
    from pdlab.attention.backends.triton_mla import decode_kernel

    return decode_kernel(p.q, p.kv_cache, config, p.block_table)
