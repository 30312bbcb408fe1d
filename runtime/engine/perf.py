"""Engine-level measurements (used by bench/gpu/runtime.sh; runs on CPU too at small sizes):

- decode throughput at batch sizes 1…256 with a fixed context: requests are placed straight into the
  running set with `context` tokens of (unwritten) KV, then timed through real `Scheduler.step()`s;
  decode cost does not depend on the KV values, so no prefill is needed to set it up;
- the host share of a decode step: step wall time vs. GPU time of forward + sampling (CUDA events,
  PDLAB_STEP_PROFILE=1), and the scheduler + post-processing part of the wall time;
- TTFT for one request of N prompt tokens (arrival → first token through the scheduler).

`python -m pdlab.runtime.engine.perf --model-path synthetic:deepseek-r1:4 --out DIR` writes
decode.csv / ttft.csv / perf.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from pdlab.runtime.core import Req, ReqStatus, SamplingParams, filler_ids
from pdlab._subcommands import arg_parser


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_throughput(llm, batch_sizes: list[int], context: int, steps: int = 20, warmup: int = 3,
                      overlap: bool = False, on_row=None, profiler=None) -> list[dict]:
    """Rows: batch, context, overlap, step_ms, tok_per_s, gpu_ms, host_share, sched_share.
    step_ms: plain schedule, the median of the steps, each between two device syncs (the host waits for every
    step there anyway); overlap schedule, the wall time of all measured steps run back to back without a sync,
    divided by their number (a sync after each step would keep the next step's launch, and the host work before
    it, from overlapping the step running). gpu_ms: the median GPU time of forward+sampling (CUDA events).
    host_share = 1 - gpu_ms / step_ms (the part of a step the GPU idles).
    profiler: a cProfile.Profile enabled around each measured step (where the host time goes); each step is
    then timed between syncs in either schedule."""
    sched, eng = llm.scheduler, llm.engine
    sched.overlap = overlap
    vocab = eng.vocab_size
    rows = []
    for bs in batch_sizes:
        reqs = []
        for i in range(bs):
            r = Req(filler_ids(context, vocab, stride=1, salt=7 * i),
                    SamplingParams(temperature=0.0, max_tokens=steps + warmup + 2, ignore_eos=True))
            r.seed = i + 1
            r.output_ids = [3]
            r.cached_len = context  # KV of the prompt is "there" (values do not affect speed)
            r.pages = eng.pool.allocate(eng.pool.allocator.pages_for(context + steps + warmup + 2))
            r.status = ReqStatus.RUNNING
            r.admitted_at = sched.num_admitted
            sched.num_admitted += 1
            sched.by_rid[r.rid] = r
            sched.decode.add(r)
            reqs.append(r)
        walls, gpus, hosts = [], [], []
        pipelined = overlap and profiler is None
        for k in range(warmup + steps):
            if not pipelined or k == warmup:
                _sync(eng.device)
            if pipelined and k == warmup:
                t_run = time.perf_counter()
            t0 = time.perf_counter()
            if profiler is not None and k >= warmup:
                profiler.enable()
            sched.step()
            if not pipelined:
                _sync(eng.device)
            if profiler is not None and k >= warmup:
                profiler.disable()
            wall = (time.perf_counter() - t0) * 1e3
            if k >= warmup:
                walls.append(wall)
                gpus.append(eng.last_gpu_ms)
                ls = sched.last_step
                hosts.append(ls["schedule_ms"] + ls["process_ms"])
        if pipelined:  # the last step launched (each step launches one and processes the one before)
            _sync(eng.device)
            run_ms = (time.perf_counter() - t_run) * 1e3
        for r in reqs:
            sched.abort(r.rid)
        while sched.has_work:  # a launched step of aborted requests
            sched.step()
        step = run_ms / steps if pipelined else statistics.median(walls)
        gpu = statistics.median(gpus)
        rows.append({"batch": bs, "context": context, "overlap": overlap, "step_ms": step, "tok_per_s": bs / step * 1e3,
                     "gpu_ms": gpu, "host_share": max(0.0, 1.0 - gpu / step) if eng.profile else None,
                     "sched_share": statistics.median(hosts) / step,
                     "graph": eng.graphs is not None and eng.graphs.can_run(bs)})
        print(json.dumps(rows[-1]), flush=True)
        if on_row is not None:
            on_row(rows[-1])
    return rows


def _profile_host(llm, batch: int, context: int, steps: int, overlap: bool, path: Path) -> None:
    """cProfile of `steps` decode steps at `batch`: the 40 functions with the most own time, then by
    cumulative time, written to `path` (the step times of the profiled run are inflated by the profiler)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    row = decode_throughput(llm, [batch], context, steps, overlap=overlap, profiler=prof)[0]
    buf = io.StringIO()
    buf.write(f"decode steps at batch {batch}, context {context}, overlap {overlap}, under cProfile: {json.dumps(row)}\n")
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(buf.getvalue())
    print(f"host profile: {path}", flush=True)


def ttft(llm, prompt_len: int, repeats: int = 3) -> dict:
    """Median arrival → first-token time (ms) of one request with `prompt_len` prompt tokens."""
    vocab = llm.engine.vocab_size
    times = []
    for k in range(repeats + 1):
        ids = filler_ids(prompt_len, vocab, stride=11, salt=k)
        req = Req(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        _sync(llm.engine.device)
        t0 = time.perf_counter()
        llm.scheduler.add_request(req)
        while not req.finished:
            llm.scheduler.step()
        _sync(llm.engine.device)
        if k > 0:  # the first run warms up kernels for this shape
            times.append((time.perf_counter() - t0) * 1e3)
    return {"prompt_len": prompt_len, "ttft_ms": statistics.median(times), "runs": times}


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(prog="python -m pdlab.runtime.engine.perf",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ttft-lens", default="1024,8192")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--overlap-too", action="store_true", help="repeat the decode sweep with the overlap schedule")
    p.add_argument("--profile-host", type=int, default=0, metavar="BATCH",
                   help="also run BATCH-sized decode steps under cProfile (both schedules with --overlap-too) "
                        "and write the hottest functions to OUT/host_profile*.txt")
    p.add_argument("--out", default="perf_out")
    a = p.parse_args(argv)
    os.environ.setdefault("PDLAB_STEP_PROFILE", "1")
    from pdlab.runtime.engine.loop import LLM
    sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    ttft_lens = [int(x) for x in a.ttft_lens.split(",") if x]
    need = max(max(sizes) * (a.context + a.steps + 64), max(ttft_lens, default=0) + 64)
    t0 = time.perf_counter()
    llm = LLM(model_path=a.model_path, device=a.device, page_size=a.page_size, kv_dtype=a.kv_dtype,
              max_total_tokens=a.max_total_tokens or need + 4096, max_running_requests=max(sizes),
              max_context_len=max(a.context + a.steps + 64, max(ttft_lens, default=0) + 64),
              chunked_prefill_size=8192, max_prefill_tokens=8192, disable_cuda_graph=a.disable_cuda_graph,
              cuda_graph_bs=None if a.disable_cuda_graph else sizes)
    load_s = time.perf_counter() - t0
    lines = llm.engine.describe()
    print("\n".join(lines), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd
    dec: list[dict] = []

    def save_row(row):  # partial results survive a timeout
        dec.append(row)
        pd.DataFrame(dec).to_csv(out / "decode.csv", index=False)

    decode_throughput(llm, sizes, a.context, a.steps, on_row=save_row)
    if a.overlap_too:
        decode_throughput(llm, sizes, a.context, a.steps, overlap=True, on_row=save_row)
    if a.profile_host:
        for overlap in ([False, True] if a.overlap_too else [False]):
            _profile_host(llm, a.profile_host, a.context, a.steps, overlap,
                          out / f"host_profile{'_overlap' if overlap else ''}.txt")
    tt = [ttft(llm, n) for n in ttft_lens]
    for row in tt:
        print(json.dumps(row), flush=True)
    pd.DataFrame([{k: v for k, v in r.items() if k != "runs"} for r in tt]).to_csv(out / "ttft.csv", index=False)
    (out / "perf.json").write_text(json.dumps({"startup": lines, "load_s": load_s, "decode": dec, "ttft": tt,
                                               "args": vars(a)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
