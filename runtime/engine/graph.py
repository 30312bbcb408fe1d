"""CUDA graphs for decode steps: one graph per captured batch size, a batch runs in the smallest
captured size >= its size, padded with rows that point at the dummy page-table row (page 0).

Static buffers (max captured size): input_ids, positions, rows [max_bs] int64; the graph itself
gathers the block table and computes slots from them, so a replay is three small copies. An attention backend
that plans on the host (flashinfer) is captured under `replayed_graph_capture(seqlens)` and re-planned for each
replay's host lengths before it (its schedule and metadata live in fixed buffers the graph reads).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pdlab.attention.ops import ReplayedCapture, replayed_graph_capture
from pdlab.kernels.graphs import capture_graph
from pdlab.runtime.core import Req

log = logging.getLogger("pdlab.runtime")


def default_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class GraphRunner:
    def __init__(self, engine, batch_sizes: list[int] | None = None, capture: bool = True):
        """capture=False keeps the static buffers and padding but runs the forward eagerly at replay
        (for checking the buffer plumbing on CPU)."""
        if capture and engine.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; run decode eagerly on CPU (--disable-cuda-graph)")
        self.capture = capture
        self.engine = engine
        self.batch_sizes = sorted(set(batch_sizes or default_batch_sizes(engine.max_running_requests)))
        max_bs = self.batch_sizes[-1]
        d = engine.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=d)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=d)
        self.rows = torch.full((max_bs,), engine.page_table.dummy_row, dtype=torch.int64, device=d)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replans: dict[int, ReplayedCapture] = {}  # per batch size: host-planned backends to re-plan
        self.replan_errors: dict[int, str] = {}  # per batch size: the last re-plan that failed (the step ran eagerly)
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def can_run(self, bs: int) -> bool:
        return bs <= self.batch_sizes[-1]

    def _capture(self) -> None:
        free0 = torch.cuda.mem_get_info(self.engine.device)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.engine.device)
        # the graphs are replayed on other lengths and block tables: the warm-up and the capture choose the same
        # attention backends, and one that plans on the host plans the capture's lengths (positions 0: one token
        # per row) and is re-planned before each replay
        for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory
            with replayed_graph_capture(torch.ones(bs, dtype=torch.int32)) as cap:
                args = self.engine.decode_tensors(self.input_ids[:bs], self.positions[:bs], self.rows[:bs], bs)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (autotuning, lazy init) outside the capture
                        self.engine.model.forward(*args)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with capture_graph(g, pool=pool):  # a failed capture leaves the process usable eagerly
                    args = self.engine.decode_tensors(self.input_ids[:bs], self.positions[:bs], self.rows[:bs], bs)
                    self.outputs[bs] = self.engine.model.forward(*args)
                self.graphs[bs] = g
            if len(cap):
                self.replans[bs] = cap
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info(self.engine.device)[0]
        log.info("captured %d decode graphs in %.1f s (free memory %.2f -> %.2f GiB)%s", len(self.graphs),
                 time.perf_counter() - t0, free0 / 2**30, free1 / 2**30,
                 f"; {len(self.replans)} re-planned on the host before each replay" if self.replans else "")

    def replay(self, reqs: list[Req], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decode step of `reqs` in a captured graph; returns logits [len(reqs), V] (a view).
        input_ids: optional [len(reqs)] int64 device tensor of input tokens (else read from reqs)."""
        n = len(reqs)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        host = torch.empty((3, bs), dtype=torch.int64, pin_memory=self.engine.device.type == "cuda")
        host[0, :n] = 0 if input_ids is not None else torch.tensor([r.token_at(r.cached_len) for r in reqs])
        host[1, :n] = torch.tensor([r.cached_len for r in reqs])
        host[2, :n] = torch.tensor([r.table_row for r in reqs])
        host[0, n:] = 0
        host[1, n:] = 0
        host[2, n:] = self.engine.page_table.dummy_row
        dev = host.to(self.engine.device, non_blocking=True)
        self.input_ids[:bs].copy_(dev[0])
        self.positions[:bs].copy_(dev[1])
        self.rows[:bs].copy_(dev[2])
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)
        eager = not self.capture
        if not eager and bs in self.replans:  # the step's lengths, padding rows included (position 0: one token)
            try:
                self.replans[bs].replan((host[1] + 1).to(torch.int32))
            except (RuntimeError, ValueError) as exc:  # the graph would replay a stale plan: this step runs eagerly
                if bs not in self.replan_errors:
                    log.warning("re-planning the batch-%d decode graph failed (%s); such steps run eagerly", bs, exc)
                self.replan_errors[bs] = f"{type(exc).__name__}: {exc}"
                eager = True
        if eager:
            args = self.engine.decode_tensors(self.input_ids[:bs], self.positions[:bs], self.rows[:bs], bs)
            return self.engine.model.forward(*args)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
