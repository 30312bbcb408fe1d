"""The timing harness every pdlab benchmark and tuner uses.

GPU: CUDA events around each call, warm-up first, L2 flushed before each timed call (or input sets
rotated), a short GPU sleep before the start event so host launch overhead stays outside the timing, optional CUDA-graph mode (N calls captured once, replayed; time per call) for small
kernels, median and p10/p90 over the repeats, a barrier first when torch.distributed is initialised.
CPU: `time.perf_counter` with the same interface; results carry `kind="cpu"` so reports label them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from pdlab.kernels.graphs import capture_graph, capturing


@dataclass(frozen=True)
class Timing:
    """Per-call times in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    repeats: int
    kind: str  # "cuda", "cuda-graph" or "cpu"

    @property
    def seconds(self) -> float:
        return self.median_ms / 1e3

    def as_dict(self) -> dict:
        return asdict(self)


_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    buf = _L2_FLUSH.get(device)
    if buf is None:
        size = 256 << 20  # beyond any L2 (H200: 60 MB, B200: 126 MB)
        buf = _L2_FLUSH[device] = torch.empty(size, dtype=torch.uint8, device=device)
    buf.zero_()


def _host_lead(cycles: int = 200_000) -> None:
    """Keep the GPU busy (~100 us) before the start event, so the host has enqueued the timed call
    by the time the GPU reaches it: otherwise a slow host (Python launch overhead, a busy CPU) shows
    up as GPU idle time inside the measurement."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def _quantiles(times: Sequence[float], kind: str) -> Timing:
    ts = sorted(times)
    n = len(ts)

    def q(p: float) -> float:
        return ts[min(n - 1, max(0, int(round(p * (n - 1)))))]

    return Timing(statistics.median(ts), q(0.1), q(0.9), statistics.fmean(ts), ts[0], n, kind)


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def bench(fn: Callable[[], object], *, device: torch.device | str | None = None, warmup: int = 5,
          repeats: int = 50, flush_l2: bool = True, cuda_graph: bool = False, graph_calls: int = 20,
          setup: Callable[[int], object] | None = None, max_seconds: float = 10.0) -> Timing:
    """Time `fn()` and return per-call statistics.

    device: where fn runs (default: CUDA if available, else CPU). setup(i), if given, runs before
    call i outside the timed region (e.g. to pick the i-th of several rotating input sets).
    cuda_graph: capture `graph_calls` calls into one graph and time replays (per-call time =
    replay time / graph_calls); flush_l2 then applies once per replay. Timing stops early once
    `max_seconds` of wall time is spent (at least 3 repeats)."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda":
        return _bench_cpu(fn, warmup=max(1, min(warmup, 3)), repeats=repeats, setup=setup,
                          max_seconds=max_seconds)
    for i in range(warmup):
        if setup:
            setup(i)
        fn()
    torch.cuda.synchronize(dev)
    if cuda_graph:
        return _bench_graph(fn, dev, repeats, graph_calls, flush_l2, max_seconds)
    _barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    t0 = time.perf_counter()
    done = 0
    for i in range(repeats):
        if setup:
            setup(i)
        if flush_l2:
            _flush_l2(dev)
        _host_lead()
        starts[i].record()
        fn()
        ends[i].record()
        done += 1
        if done >= 3 and i % 8 == 7:
            ends[i].synchronize()
            if time.perf_counter() - t0 > max_seconds:
                break
    torch.cuda.synchronize(dev)
    return _quantiles([s.elapsed_time(e) for s, e in zip(starts[:done], ends[:done])], "cuda")


def _bench_graph(fn, dev, repeats, graph_calls, flush_l2, max_seconds) -> Timing:
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # one more warm-up on the capture stream
        torch.cuda.synchronize(dev)
        with capture_graph(graph, stream=stream):  # a call that cannot be captured leaves the process usable
            for _ in range(graph_calls):
                fn()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize(dev)
    times = []
    t0 = time.perf_counter()
    for _ in range(repeats):
        if flush_l2:
            _flush_l2(dev)
        _host_lead()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / graph_calls)
        if len(times) >= 3 and time.perf_counter() - t0 > max_seconds:
            break
    del graph
    return _quantiles(times, "cuda-graph")


def _bench_cpu(fn, *, warmup, repeats, setup, max_seconds) -> Timing:
    for i in range(warmup):
        if setup:
            setup(i)
        fn()
    times = []
    t0 = time.perf_counter()
    for i in range(repeats):
        if setup:
            setup(i)
        s = time.perf_counter()
        fn()
        times.append((time.perf_counter() - s) * 1e3)
        if len(times) >= 3 and time.perf_counter() - t0 > max_seconds:
            break
    return _quantiles(times, "cpu")


def cosine_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """FlashMLA's closeness measure 1 - 2Σxy / Σ(x² + y²) in fp64: 0 when equal (x [...] and y [...] any shapes and
    float dtypes that broadcast; NaN anywhere gives NaN)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


@contextlib.contextmanager
def reference_checked(op: str, backend: str, *, dump_dir: str | None = None, max_dumps: int = 4):
    """Within the block every call of registered `backend` of `op` made outside CUDA-graph capture is
    also run through the op's reference backend (the torch fp32 oracle) on the same inputs, and the
    two results compared with `cosine_error` per returned tensor.

    Yields a list that receives one dict per call: "shapes" (of the tensor arguments), "errors" (one
    float per returned tensor), "config" (the config the backend ran), and "dump" (a .pt file with the
    inputs, for the first `max_dumps` calls whose error exceeds 1e-4, when `dump_dir` is given). The
    backend's own results are returned to the caller unchanged. A serving check, not a timing tool:
    the reference is slow and syncs the host."""
    from pathlib import Path

    from pdlab.kernels import registry

    target = registry.get_backend(op, backend)
    oracle = next(b for b in registry.backends(op) if b.reference)
    impl, calls = target.impl, []

    def checked(*args, config=None, **kwargs):
        got = impl(*args, config=config, **kwargs)
        if capturing():
            return got
        want = oracle.impl(*args, **kwargs)
        got_t = got if isinstance(got, tuple) else (got,)
        want_t = want if isinstance(want, tuple) else (want,)
        rec = {"call": len(calls), "shapes": [list(a.shape) for a in args if torch.is_tensor(a)],
               "errors": [cosine_error(g, w) for g, w in zip(got_t, want_t)], "config": dict(config or {})}
        bad = not all(e <= 1e-4 for e in rec["errors"])  # NaN counts as bad
        if bad and dump_dir and sum(1 for c in calls if "dump" in c) < max_dumps:
            path = Path(dump_dir) / f"{op}_{backend}_call{len(calls)}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": [a.cpu() if torch.is_tensor(a) else a for a in args],
                        "kwargs": {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()},
                        "config": config}, path)
            rec["dump"] = str(path)
        calls.append(rec)
        return got

    target.impl = checked
    try:
        yield calls
    finally:
        target.impl = impl
