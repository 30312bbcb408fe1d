"""`tune dispatch`: token dispatch + combine (op `moe_dispatch`) at a model's shapes, through the public
`pdlab.moe.dispatch.create_dispatcher(...).dispatch/combine`.

Buckets: tokens_per_rank {16, 128, 512, 4096} × ranks {--ep} × mode {normal, low_latency (≤ 256 tokens
per rank)} × payload {bf16, nvfp4}, with hidden, experts and top_k of the model. One trial = dispatch
→ identity experts → combine; the expected output is x · Σ topk_weights, computed on each rank.
`--ep N` (N > 1) starts N ranks on N GPUs (gloo on CPU): rank 0 runs the search and announces every
measurement, the other ranks measure in step (`search.Lockstep`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from pdlab._subcommands import int_arg
from pdlab.bench.harness import cosine_error
from pdlab.tuning.command import add_common_arguments, run_tune
from pdlab.tuning.models import ModelShape
from pdlab.tuning.target import TuneTarget, register_target

TOKENS_PER_RANK = (16, 128, 512, 4096)
LOW_LATENCY_MAX = 256
PAYLOADS = ("bf16", "fp8", "nvfp4")
_RANKS = [1]  # set by --ep before buckets are built


def dispatch_buckets(model: ModelShape) -> list[dict]:
    out = []
    for ranks in _RANKS:
        for t in TOKENS_PER_RANK:
            for mode in ("normal", "low_latency"):
                if mode == "low_latency" and t > LOW_LATENCY_MAX:
                    continue
                for payload in PAYLOADS:
                    out.append({"tokens_per_rank": t, "ranks": ranks, "mode": mode, "payload": payload,
                                "hidden": model.hidden_size, "experts": model.n_routed_experts,
                                "top_k": model.num_experts_per_tok})
    return out


class DispatchInputs:
    """This rank's tokens [T, H] bf16, top-k ids [T, k] int32 and weights [T, k] fp32, plus the
    dispatchers built so far (one per backend × config) and their dequantized receive buffers."""

    def __init__(self, bucket: dict, model: ModelShape, device: torch.device) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        T, H, E, k = bucket["tokens_per_rank"], bucket["hidden"], bucket["experts"], bucket["top_k"]
        g = torch.Generator(device=device).manual_seed(100 + rank)
        self.bucket = bucket
        self.x = torch.randn(T, H, generator=g, device=device, dtype=torch.bfloat16)
        self.topk_ids = torch.rand(T, E, generator=g, device=device).topk(k, dim=1).indices.to(torch.int32)
        self.topk_weights = torch.softmax(torch.randn(T, k, generator=g, device=device), dim=1)
        self.global_scale = None
        if bucket["payload"] == "nvfp4":
            from pdlab.kernels.nvfp4 import global_scale_from_amax

            # the layer's static activation scale, the same on every rank (randn stays below 8)
            self.global_scale = torch.as_tensor(global_scale_from_amax(8.0), dtype=torch.float32).to(device)
        self.dispatchers: dict = {}
        self.dequantized: dict = {}


def _call(backend: str, cfg: dict, x: DispatchInputs):
    from pdlab.moe.dispatch import create_dispatcher

    key = (backend, tuple(sorted((cfg or {}).items())))
    d = x.dispatchers.get(key)
    if d is None:
        b = x.bucket
        d = x.dispatchers[key] = create_dispatcher(backend, b["experts"], b["hidden"], mode=b["mode"],
                                                   num_max_dispatch_tokens_per_rank=b["tokens_per_rank"],
                                                   config=cfg)
    layout, handle = d.dispatch(x.x, x.topk_ids, x.topk_weights, x.bucket["payload"], global_scale=x.global_scale)
    if layout.payload != "bf16":  # identity experts on a quantized payload: its values in bf16, computed once
        if key not in x.dequantized:
            from pdlab.moe.layouts import dequantize_hidden

            x.dequantized[key] = dequantize_hidden(layout, torch.bfloat16)  # fp8 and nvfp4 payloads alike
        layout = dataclasses.replace(layout, hidden=x.dequantized[key], payload="bf16", scales=None,
                                     global_scale=None)
    return d.combine(layout, handle)


def _expected(x: DispatchInputs) -> torch.Tensor:
    return x.x.float() * x.topk_weights.sum(dim=1, keepdim=True)


def _tolerance(bucket) -> float:
    # bf16: combine sums in fp32, only the output rounding differs. nvfp4: the payload's own
    # quantization error (e2m1 with e4m3 block scales, ~10 % RMS per element → ~5e-3 cosine).
    return 1e-4 if bucket["payload"] == "bf16" else 2e-2


def _payload_problem(model: ModelShape, payloads: list[str]) -> str | None:
    """Why some of `payloads` cannot carry the model's tokens (its hidden size is not a multiple of the payload's
    scale block), else None: every bucket of that payload would fail at run time."""
    from pdlab.moe.dispatch.base import payload_size_problem

    problems = [p for p in (payload_size_problem(kind, model.hidden_size) for kind in payloads) if p]
    if not problems:
        return None
    fits = [kind for kind in PAYLOADS if not payload_size_problem(kind, model.hidden_size)]
    return "; ".join(problems) + "; pass a config whose hidden size fits, or tune the payloads it fits alone " \
        f"(--only payload={','.join(fits)})"


def _accepts(backend, bucket) -> bool:
    o = backend.options or {}
    if bucket["ranks"] > int(o.get("max_ranks", 1 << 30)):
        return False
    if o.get("needs_process_group") and bucket["ranks"] < 2:
        return False
    return bucket["mode"] in o.get("modes", (bucket["mode"],)) and bucket["payload"] in o.get("payloads", (bucket["payload"],))


MOE_DISPATCH = register_target(TuneTarget(
    op="moe_dispatch", description="MoE token dispatch + combine",
    buckets=dispatch_buckets, build=lambda b, m, d: DispatchInputs(b, m, d), call=_call,
    error=lambda out, ref: cosine_error(out, ref), tolerance=_tolerance, accepts=_accepts,
    reference_output=_expected, modules=("pdlab.moe.dispatch",),
    bucket_doc="tokens_per_rank × ranks (--ep) × mode × payload at the model's hidden/experts/top_k"))

OPS = ("moe_dispatch",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, OPS, "moe_dispatch")
    parser.add_argument("--ep", type=int_arg(1), default=1, help="ranks to dispatch across (starts that many "
                        "processes, one GPU each; gloo on CPU); default 1 (the local dispatcher)")


def _model_problem(args: argparse.Namespace) -> str | None:
    """The one-line refusal of the model tuned (R1's, a config file's, or the small CPU shape's under --arch cpu): a
    hidden size some payload cannot carry, or an --ep that does not divide its experts; else None. Checked before
    any rank starts; a --model that cannot be read is left to run_tune."""
    from pdlab.kernels.arch import detect_arch
    from pdlab.tuning.command import parse_only
    from pdlab.tuning.models import cpu_shape, load_model_shape

    try:
        model = load_model_shape(args.model)
        payloads = parse_only(args.only).get("payload") or list(PAYLOADS)
    except (OSError, ValueError):
        return None
    if (args.arch or detect_arch()).lower() == "cpu":
        model = cpu_shape(args.model, model)
    problem = _payload_problem(model, [p for p in payloads if p in PAYLOADS])
    if problem:
        return f"tune dispatch: --model {args.model!r}: {problem}"
    experts = model.n_routed_experts
    if experts % args.ep == 0:
        return None
    sizes = ", ".join(str(n) for n in range(1, min(experts, 64) + 1) if experts % n == 0)
    return (f"tune dispatch: --ep {args.ep} does not divide the {experts} experts of {model.name}; choose one of "
            f"{sizes}")


def run(args: argparse.Namespace) -> int:
    problem = _model_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    _RANKS[:] = [args.ep]
    if args.ep <= 1 or args.dry_run:
        return run_tune("tune dispatch", args, OPS)
    from pdlab.tuning.command import arch_gate, arch_problem
    from pdlab.kernels.arch import detect_arch

    refusal = arch_problem("tune dispatch", args.arch) or arch_gate("tune dispatch", args.arch, detect_arch(),
                                                                     args.dry_run)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    from pdlab.moe.dispatch.spawn import run_ranks

    codes = run_ranks(_rank_main, args.ep, vars(args), timeout_s=3600.0)
    return int(codes[0])


def _rank_main(rank: int, world_size: int, argd: dict) -> int:
    from pdlab.tuning.search import Lockstep

    args = argparse.Namespace(**argd)
    _RANKS[:] = [world_size]
    if torch.cuda.is_available() and (args.arch or "") != "cpu":
        args.device = f"cuda:{rank}"
    device = torch.device(args.device or "cpu")
    lockstep = Lockstep(device)
    if rank:
        args.no_progress = True
    return run_tune("tune dispatch", args, OPS, lockstep=lockstep)
