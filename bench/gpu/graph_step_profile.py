"""Where a CUDA-graph decode step's time goes: torch.profiler over decode steps of the synthetic DeepSeek-R1-shaped
model (full width, 4 layers) at one batch size and context, the top operations by device time and by host time.

    python -m pdlab.bench.gpu.graph_step_profile --batch 8 --context 8192 --out DIR
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdlab._subcommands import arg_parser


def main(argv: list[str] | None = None) -> int:
    from pdlab.runtime.engine.loop import LLM
    from pdlab.runtime.engine.perf import decode_throughput

    p = arg_parser(prog="python -m pdlab.bench.gpu.graph_step_profile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="synthetic:deepseek-r1:4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--out", default="graph_step_profile")
    a = p.parse_args(argv)
    llm = LLM(model_path=a.model_path, device="cuda", page_size=64, max_total_tokens=2 * a.batch * (a.context + 256),
              max_running_requests=a.batch, max_context_len=a.context + 256, cuda_graph_bs=[a.batch])
    print("\n".join(llm.engine.describe()), flush=True)
    decode_throughput(llm, [a.batch], a.context, steps=3, overlap=a.overlap)  # warm-up: shapes, caches
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        row = decode_throughput(llm, [a.batch], a.context, steps=a.steps, overlap=a.overlap)[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ka = prof.key_averages()
    text = (f"{row}\n\nby device time\n{ka.table(sort_by='cuda_time_total', row_limit=30)}\n\nby host time\n"
            f"{ka.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
    (out / f"profile_b{a.batch}{'_overlap' if a.overlap else ''}.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
