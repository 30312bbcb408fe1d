"""`bench contracts`: cost of the shape-checked op contracts per call (goal: under 10 us for an op
with 5 tensors), plus registry selection and the public NVFP4 quantize boundary for reference."""

from __future__ import annotations

import argparse
import time

import torch

from pdlab._subcommands import int_arg

GOAL_US = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int_arg(1), default=20000, help="calls per measurement (default 20000)")


def five_tensor_op():
    """The low-latency MoE experts contract: masked hidden, masked_m, w13, its scales, w2."""
    from pdlab.kernels.contracts import Op, Spec

    return Op("moe_experts_masked", inputs={
        "masked_m": Spec("E", "int32"),
        "hidden": Spec("E M K", "bf16|uint8", layout="masked", last_dim_contiguous=True),
        "w13": Spec("E 2*I K/2", "uint8", contiguous=True),
        "w13_scale": Spec("E 2*I K/16", "fp8_e4m3"),
        "w2": Spec("E K I/2", "uint8", contiguous=True),
    })


def five_tensors(device: str = "meta") -> dict[str, torch.Tensor]:
    """DeepSeek-R1 EP8 shapes (32 local experts, M 128, K 7168, I 2048), on the meta device (no memory): masked_m [E]
    int32, hidden [E, M, K] bf16 and the expert weights, by contract name."""
    e, m, k, i = 32, 128, 7168, 2048
    return {"masked_m": torch.empty(e, dtype=torch.int32, device=device),
            "hidden": torch.empty(e, m, k, dtype=torch.bfloat16, device=device),
            "w13": torch.empty(e, 2 * i, k // 2, dtype=torch.uint8, device=device),
            "w13_scale": torch.empty(e, 2 * i, k // 16, dtype=torch.float8_e4m3fn, device=device),
            "w2": torch.empty(e, k, i // 2, dtype=torch.uint8, device=device)}


def per_call_us(fn, calls: int) -> float:
    for _ in range(min(1000, calls)):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from pdlab.bench import report
    from pdlab.kernels import nvfp4, registry

    op, tensors = five_tensor_op(), five_tensors()
    x = torch.empty(128, 7168, dtype=torch.bfloat16, device="meta")
    rows = [
        {"what": "Op.check, 5 tensors (MoE masked experts)",
         "us_per_call": per_call_us(lambda: op.check("bench", **tensors), args.calls)},
        {"what": "Op.check, 1 tensor (nvfp4_quantize x)",
         "us_per_call": per_call_us(lambda: nvfp4.QUANTIZE.check("bench", x=x), args.calls)},
        {"what": "registry.select(nvfp4_quantize)",
         "us_per_call": per_call_us(lambda: registry.select("nvfp4_quantize"), args.calls)},
    ]
    df = pd.DataFrame(rows)
    report.print_table(df, f"contract overhead per call (host time; goal < {GOAL_US:g} us for 5 tensors)",
                       floatfmt="{:.2f}")
    five = rows[0]["us_per_call"]
    verdict = "within" if five < GOAL_US else "OVER"
    print(f"5-tensor check: {five:.2f} us per call, {verdict} the {GOAL_US:g} us goal")
    return 0
