"""Which steps make a serving run's latency tail? Reads the scheduler's step log (PDLAB_STEP_LOG, one JSON line per
step) and the run windows that serve_compiles.sh writes (runs.txt: `run N START END`, Unix seconds), and prints per
run and kind (prefill / decode): steps, forward ms p50 / p99 / max, and the slowest steps with their token counts,
whether a prefill step's token count had run before (in the warm-up or an earlier run), the queue, and how much the
CUDA allocator's reserved memory grew at the step (cudaMalloc calls).

    python3 bench/gpu/step_tail.py OUT_DIR [--top 8]
"""

from __future__ import annotations

import json
from pathlib import Path

from pdlab._subcommands import arg_parser


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(prog="python3 bench/gpu/step_tail.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="serve_compiles.sh's output folder (steps.jsonl, runs.txt)")
    p.add_argument("--top", type=int, default=8, help="slowest steps to list per run")
    a = p.parse_args(argv)
    steps = [json.loads(line) for line in (a.out / "steps.jsonl").read_text().splitlines() if line.strip()]
    runs = [(int(f[1]), float(f[2]), float(f[3])) for f in (ln.split() for ln in (a.out / "runs.txt").read_text()
                                                              .splitlines()) if len(f) == 4 and f[0] == "run"]
    prev = None
    for s in steps:  # the allocator's growth at each step (MiB), against the step logged before it
        s["grew"] = (s["reserved_mib"] - prev) if None not in (s.get("reserved_mib"), prev) else 0
        prev = s.get("reserved_mib")
    seen = {s["tokens"] for s in steps if s["warmup"] and s["kind"] == "prefill"}
    print(f"{len(steps)} steps logged; {sum(s['warmup'] for s in steps)} in the warm-up "
          f"({len(seen)} distinct prefill token counts)")
    for run, t0, t1 in runs:
        mine = [s for s in steps if t0 <= s["t"] <= t1 and not s["warmup"]]
        print(f"\n== run {run}: {len(mine)} steps")
        for kind in ("prefill", "decode"):
            fw = [s["forward_ms"] for s in mine if s["kind"] == kind]
            total = [s["schedule_ms"] + s["forward_ms"] + s["process_ms"] for s in mine if s["kind"] == kind]
            if fw:
                grew = sum(s["grew"] for s in mine if s["kind"] == kind)
                print(f"  {kind:7s} {len(fw):5d} steps  allocator grew {grew:5d} MiB  forward ms p50 "
                      f"{_pct(fw, .5):8.2f}  p99 {_pct(fw, .99):8.2f}  max {max(fw):8.2f}  step total max "
                      f"{max(total):8.2f}")
        print(f"  slowest {a.top} (t from the run's start):")
        for s in sorted(mine, key=lambda s: -s["forward_ms"])[:a.top]:
            new = "" if s["kind"] == "decode" else ("  seen" if s["tokens"] in seen else "  NEW token count")
            print(f"    t={s['t'] - t0:7.3f}s {s['kind']:7s} bs {s['bs']:3d} tokens {s['tokens']:6d}  "
                  f"schedule {s['schedule_ms']:7.2f} forward {s['forward_ms']:8.2f} process {s['process_ms']:7.2f} ms"
                  f"  waiting {s['waiting']:3d} running {s['running']:3d}  grew {s['grew']:4d} MiB{new}")
        seen |= {s["tokens"] for s in mine if s["kind"] == "prefill"}
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
