"""CUDA graphs for decode steps: one graph per captured batch size, a batch runs in the smallest
captured size >= its size, padded with rows that point at the dummy page-table row (page 0). Small prefill steps
replay graphs too (`PrefillGraphRunner`, below): an eager prefill step is host-bound up to hundreds of tokens.

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


PREFILL_GRAPH_SEQS = 8  # prompts (or chunks) one prefill graph holds; a step with more runs eagerly


def default_prefill_token_sizes(max_tokens: int) -> list[int]:
    """The token counts prefill graphs are captured at: powers of two from 16 up to max_tokens, and max_tokens."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048) if s < max_tokens]
    return sizes + [max_tokens] if max_tokens > 0 else []


class PrefillGraphRunner:
    """CUDA graphs for prefill steps of at most `max(token_sizes)` tokens over at most PREFILL_GRAPH_SEQS sequences,
    each at most `positions` tokens long (cached prefix included): a step runs in the graph of the smallest
    captured token count T_pad >= its T tokens.

    Every graph holds S = PREFILL_GRAPH_SEQS + 1 sequences. The step's B sequences come first; sequences B..S-2
    are empty (no new token, length 0); the last one is the padding: the T_pad - T padding tokens at positions
    0, 1, … on the dummy page-table row, with slots -1 (their KV is never written). Its outputs, and those of the
    empty sequences, are dropped. The block table is the first `positions / page_size` columns of each row, so
    the attention kernels see the same width in every replay. The MoE layers run in normal mode: one GPU's normal
    dispatch does not sync with the host (`expand(all_local=True)`); a dispatcher that syncs makes the capture
    fail, and prefill then runs eagerly (`Engine.prefill_graph_error`). Host-planned attention backends are skipped
    inside the graphs (`replayed_graph_capture(None)`). capture=False runs the same padded step eagerly (the
    buffer plumbing, checkable on CPU)."""

    def __init__(self, engine, token_sizes: list[int], capture: bool = True, pool=None):
        if capture and engine.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; run prefill eagerly on CPU")
        if not token_sizes or min(token_sizes) < 1:
            raise ValueError(f"prefill graph token sizes must be positive, got {token_sizes}")
        self.capture = capture
        self.engine = engine
        self.token_sizes = sorted(set(token_sizes))
        self.max_seqs = min(PREFILL_GRAPH_SEQS, engine.max_running_requests)
        ps = engine.page_size
        if self.token_sizes[-1] > engine.page_table.max_pages * ps:
            raise ValueError(f"prefill graphs of {self.token_sizes[-1]} tokens exceed the context "
                             f"({engine.page_table.max_pages * ps} tokens): lower the largest size")
        self.width = -(-self.token_sizes[-1] // ps)  # block-table columns
        self.positions = self.width * ps  # the longest sequence a graph serves
        t_max, S, d = self.token_sizes[-1], self.max_seqs + 1, engine.device
        self.input_ids = torch.zeros(t_max, dtype=torch.int64, device=d)
        self.pos = torch.zeros(t_max, dtype=torch.int64, device=d)
        self.slots = torch.full((t_max,), -1, dtype=torch.int64, device=d)
        self.rows = torch.full((S,), engine.page_table.dummy_row, dtype=torch.int64, device=d)
        self.seqlens = torch.zeros(S, dtype=torch.int32, device=d)
        self.qo_indptr = torch.zeros(S + 1, dtype=torch.int32, device=d)
        self.last = torch.zeros(S, dtype=torch.int64, device=d)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture(pool)

    def can_run(self, batch) -> bool:
        """Whether `batch` (a prefill Batch) fits a graph: tokens, sequences and lengths."""
        return (not batch.is_decode and len(batch.reqs) <= self.max_seqs
                and sum(batch.extend_lens) <= self.token_sizes[-1]
                and all(r.cached_len + n <= self.positions for r, n in zip(batch.reqs, batch.extend_lens)))

    def _args(self, t_pad: int):
        """(input_ids, positions, ForwardContext) over the static buffers for a graph of t_pad tokens."""
        from pdlab.runtime.context import ForwardContext

        eng = self.engine
        block_table = eng.page_table.table.index_select(0, self.rows)[:, :self.width]
        ctx = ForwardContext(is_decode=False, block_table=block_table, seqlens=self.seqlens, qo_indptr=self.qo_indptr,
                             slots=self.slots[:t_pad], logits_indices=self.last, kv_caches=eng.pool.kv_caches,
                             kv_scale=eng.pool.kv_scale, max_q_len=t_pad)
        return self.input_ids[:t_pad], self.pos[:t_pad], ctx

    def _fill(self, reqs, ext, t_pad: int) -> None:
        """Write a step's B sequences (and the padding) into the static buffers: one host buffer, one copy."""
        ps, S, t_max = self.engine.page_size, self.max_seqs + 1, self.token_sizes[-1]
        B, T = len(reqs), sum(ext)
        host = torch.zeros(3 * t_max + 4 * S + 1, dtype=torch.int64, pin_memory=self.engine.device.type == "cuda")
        ids, pos, slots = host[:t_max], host[t_max:2 * t_max], host[2 * t_max:3 * t_max]
        rows, seqlens = host[3 * t_max:3 * t_max + S], host[3 * t_max + S:3 * t_max + 2 * S]
        qo, last = host[3 * t_max + 2 * S:3 * t_max + 3 * S + 1], host[3 * t_max + 3 * S + 1:]
        t = 0
        for b, (r, n) in enumerate(zip(reqs, ext)):
            ids[t:t + n] = torch.tensor(r.tokens(r.cached_len, r.cached_len + n))
            p = torch.arange(r.cached_len, r.cached_len + n)
            pos[t:t + n] = p
            slots[t:t + n] = torch.tensor(r.pages, dtype=torch.int64)[p // ps] * ps + p % ps
            rows[b] = r.table_row
            seqlens[b] = r.cached_len + n
            t += n
            qo[b + 1] = t
            last[b] = t - 1
        pos[T:t_pad] = torch.arange(t_pad - T)  # the padding sequence's tokens: positions 0, 1, …, slots -1
        slots[T:] = -1
        rows[B:] = self.engine.page_table.dummy_row
        qo[B + 1:S] = T
        qo[S] = t_pad
        seqlens[S - 1] = t_pad - T
        dev = host.to(self.engine.device, non_blocking=True)
        self.input_ids.copy_(dev[:t_max])
        self.pos.copy_(dev[t_max:2 * t_max])
        self.slots.copy_(dev[2 * t_max:3 * t_max])
        self.rows.copy_(dev[3 * t_max:3 * t_max + S])
        self.seqlens.copy_(dev[3 * t_max + S:3 * t_max + 2 * S])
        self.qo_indptr.copy_(dev[3 * t_max + 2 * S:3 * t_max + 3 * S + 1])
        self.last.copy_(dev[3 * t_max + 3 * S + 1:])

    def _capture(self, pool) -> None:
        eng = self.engine
        free0 = torch.cuda.mem_get_info(eng.device)[0]
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(eng.device)
        for t_pad in reversed(self.token_sizes):  # largest first: later graphs reuse its memory
            self._fill([], [], t_pad)  # every token in the padding sequence
            with replayed_graph_capture(None):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (kernel compilation, lazy init) outside the capture
                        eng.model.forward(*self._args(t_pad))
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with capture_graph(g, pool=pool):
                    self.outputs[t_pad] = eng.model.forward(*self._args(t_pad))
                self.graphs[t_pad] = g
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info(eng.device)[0]
        log.info("captured %d prefill graphs (up to %d tokens, %d sequences of at most %d tokens) in %.1f s "
                 "(free memory %.2f -> %.2f GiB)", len(self.graphs), self.token_sizes[-1], self.max_seqs,
                 self.positions, time.perf_counter() - t0, free0 / 2**30, free1 / 2**30)

    def replay(self, batch) -> torch.Tensor:
        """Run the prefill step `batch` (`can_run(batch)`) in a captured graph; returns logits [B, V] (a view) of
        each sequence's last new token."""
        reqs, ext = batch.reqs, batch.extend_lens
        t_pad = self.token_sizes[bisect.bisect_left(self.token_sizes, sum(ext))]
        self._fill(reqs, ext, t_pad)
        if not self.capture:
            return self.engine.model.forward(*self._args(t_pad))[:len(reqs)]
        self.graphs[t_pad].replay()
        return self.outputs[t_pad][:len(reqs)]
