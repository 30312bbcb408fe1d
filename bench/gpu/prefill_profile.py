"""Where an eager prefill step's time goes: the served model (the embedded tiny one by default) after the start-up
warm-up, prefill steps of one prompt at several lengths timed through the scheduler (host wall time of the whole
step, GPU work included), then torch.profiler over steps of one length (the top operations by host time and by
device time, and the host-device syncs), cProfile over the same (the Python functions by cumulative and own time), and
the pdlab call site of every host-device sync of one step (torch.cuda.set_sync_debug_mode).

    python3 bench/gpu/prefill_profile.py --tokens 16,128,512,2048 --profile-tokens 128 --out DIR
    python3 bench/gpu/prefill_profile.py --prefill-graph-tokens 256 ...   # prefill graphs up to 256 tokens
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
            "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def _prefill_ms(llm, n: int, reps: int) -> list[float]:
    from pdlab.runtime.core import Req, SamplingParams
    sched, out = llm.scheduler, []
    for i in range(reps):
        sched.add_request(Req([(7 * i + j) % 500 + 3 for j in range(n)],
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched.step()  # the prefill step: forward, sample, finish (max_tokens 1)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
        while sched.has_work:
            sched.step()
    return out


def _sync_sites(llm, n: int) -> list[str]:
    """The pdlab frames (file:line function) under each host-device sync of one prefill step of n tokens."""
    import pdlab

    sites: Counter = Counter()
    root = str(Path(pdlab.__file__).resolve().parent)  # the package's own files, wherever it is installed

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if str(Path(f.filename).resolve()).startswith(root)]
        frames = [f for f in frames if "prefill_profile" not in f.filename][-3:]
        sites[" < ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                         for f in reversed(frames))] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _prefill_ms(llm, n, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    own = "(no pdlab frame: the timing loop's own torch.cuda.synchronize)"
    return [f"{c:3d}x {site or own}" for site, c in sites.most_common()]


def main(argv: list[str] | None = None) -> int:
    from pdlab.runtime.engine.loop import LLM

    p = arg_parser(prog="python3 bench/gpu/prefill_profile.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    p.add_argument("--tokens", default="16,128,512,2048")
    p.add_argument("--profile-tokens", type=int, default=128, help="0: the timings only")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="cuda_graph_max_prefill_tokens (default: the runtime's, 0: eager prefill; e.g. 256)")
    p.add_argument("--out", default="prefill_profile")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in a.tokens.split(",")]
    extra = {} if a.prefill_graph_tokens is None else {"cuda_graph_max_prefill_tokens": a.prefill_graph_tokens}
    llm = LLM(model_path=a.model_path, device="cuda", page_size=64, max_total_tokens=65536, max_context_len=8192,
              max_running_requests=16, cuda_graph_bs=[1], max_prefill_tokens=max(sizes),
              chunked_prefill_size=max(sizes), **extra)
    warm = llm.scheduler.warmup()
    lines = [*llm.engine.describe(), f"warm-up: {warm}"]
    for n in sizes:
        ms = _prefill_ms(llm, n, a.reps)
        lines.append(f"prefill {n:6d} tokens: median {statistics.median(ms):8.2f} ms  min {min(ms):8.2f}  "
                     f"max {max(ms):8.2f}  ({a.reps} steps)")
        print(lines[-1], flush=True)
    if a.profile_tokens <= 0:
        (out / "prefill_profile.txt").write_text("\n".join(lines) + "\n")
        return 0
    lines += [f"\nhost-device syncs of one prefill step of {a.profile_tokens} tokens (count, innermost pdlab frame "
              "first):", *_sync_sites(llm, a.profile_tokens)]
    print("\n".join(lines[-8:]), flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _prefill_ms(llm, a.profile_tokens, 3)
    ka = prof.key_averages()
    counts = {e.key: e.count for e in ka if e.key in SYNC_OPS}
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 3 / 1e3  # kernels only (an op's own total repeats them)
    host = sum(e.self_cpu_time_total for e in ka) / 3 / 1e3
    lines += [f"\nprofile: 3 prefill steps of {a.profile_tokens} tokens; per step: device busy {busy:.2f} ms, host "
              f"in torch ops {host:.2f} ms (under the profiler); calls per step: "
              + ", ".join(f"{k} {v / 3:.0f}" for k, v in sorted(counts.items())),
              "\nby host time (self)", ka.table(sort_by="self_cpu_time_total", row_limit=40),
              "\nby device time", ka.table(sort_by="cuda_time_total", row_limit=25)]
    prof.export_chrome_trace(str(out / f"prefill_{a.profile_tokens}.trace.json"))
    py = cProfile.Profile()
    py.enable()
    _prefill_ms(llm, a.profile_tokens, 5)
    py.disable()
    for order, n in (("cumulative", 70), ("tottime", 40)):
        buf = io.StringIO()
        pstats.Stats(py, stream=buf).sort_stats(order).print_stats(n)
        lines += [f"\ncProfile, 5 prefill steps of {a.profile_tokens} tokens, by {order}", buf.getvalue()]
    text = "\n".join(lines) + "\n"
    (out / "prefill_profile.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
