"""Host time of one flashinfer re-plan of a captured decode graph (the host work before each replay), through the
wrapper's plan (with its checks) and straight through the generated module (what the adapter does after the first
plan), at 128 heads, page 64, S_q 1, lengths of 7–8k tokens, batch 1–256. Writes plan_cost.csv to --out.

    python -m pdlab.bench.gpu.flashinfer_plan_cost --out DIR
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from pdlab.attention import ops
    from pdlab.attention.backends import flashinfer_mla as fm

    p = arg_parser(prog="python -m pdlab.bench.gpu.flashinfer_plan_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default="plan_cost_out")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in (int(x) for x in a.batch_sizes.split(",")):
        steps = [torch.randint(7000, 8192, (B,), generator=gen, dtype=torch.int32) for _ in range(a.calls)]
        with ops.replayed_graph_capture(steps[0]) as cap:
            plan = fm.graph_plan_for(cap, torch.bfloat16, torch.bfloat16, dev, B, 1, a.heads, 8192 // 64 + 1, 64, 0.1)
        for mode in ("wrapper", "direct"):
            if mode == "wrapper":  # the wrapper's plan every time
                plan._fast_parts = lambda: None
                plan._fast = None
            else:
                del plan._fast_parts
                plan._fast = plan._fast_parts()
            times = []
            for lens in steps:
                t0 = time.perf_counter()
                plan.plan(lens)
                times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            rows.append({"batch": B, "heads": a.heads, "mode": mode, "median_us": statistics.median(times),
                         "p90_us": sorted(times)[int(0.9 * len(times))], "calls": len(times)})
            print(rows[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "plan_cost.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
