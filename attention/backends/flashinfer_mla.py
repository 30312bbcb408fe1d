"""`flashinfer` backend: adapter for `flashinfer.mla.BatchMLAPagedAttentionWrapper` (fa3 on sm90,
fa2 elsewhere; JIT-compiled on first use), for decode and prefill.

Two API generations, detected at run time: releases with `flashinfer.mla.MLAPlanMetadata` (0.7 on) plan from
canonical CSR metadata by keyword, with the natural-log LSE fixed at plan time, and run on the packed query
[n, H, 576] and cache [pages, page, 576] (`query=`, `kv_cache=`); older ones take the flat positional plan and the
split run(q_nope, q_pe, ckv, kpe) (the newer releases still accept that form, with deprecation warnings).
fp8 pools (uint8 e4m3 bytes, one kv_scale for the whole row) are read by the newer releases on sm90 with bf16
queries: the pool viewed as float8_e4m3fn, scale mode "kv-per-tensor", ckv_scale = kpe_scale = kv_scale (flashinfer
converts each tile to bf16 and multiplies by the scale rounded to bf16).

`plan()` does host work (and a sync), so it runs once per step and every layer of the step reuses
it: the plan is keyed by the identity and version counter of the step's metadata tensors
(seqlens, block_table, qo_indptr; in-place updates bump the version) plus shapes, dtypes, page
size, causality and scale. Each sequence lists the first ceil(kv_len / page) pages of its block-table row
(kv_indptr, kv_indices: releases from 0.7 on reject any other count); kv_len_arr = seqlens.

The plan is host work over the step's lengths, so a CUDA graph captured with it is valid only for those lengths
(graphs of a fixed step, as bench and tune time them, are fine). The runtime's decode graphs are replayed on other
lengths: there decode runs in flashinfer's CUDA-graph mode (`_GraphPlan`). Its CSR metadata lives in fixed buffers
and its schedule in a fixed integer workspace; the graph writes the step's page ids itself, from the block table
and lengths on the device (`fill_pages`). Before each replay the capture's `replan` plans the step's host lengths
into those buffers (`pdlab.attention.ops.replayed_graph_capture(seqlens)`, options `host_plan` + `graph_replan`).
The launch a graph holds depends on the plan only through flashinfer's plan info (cluster size, number of
clusters, workspace offsets), which is the same for every decode batch of one shape; a re-plan that changed it is
an error, not a stale replay.

flashinfer's fa3/fa2 scheduler has a fixed number of work items (16384 tiles of 64·cluster query rows × heads,
KV splits included); a prefill batch that needs more (e.g. 32k new tokens at 128 heads) is run in parts, split by
query rows (a part of a sequence attends to the cache up to its own last row, as causal extend does)."""

from __future__ import annotations

import inspect
import math
import weakref

import numpy as np
import torch

from pdlab.kernels.registry import register_backend

WORKSPACE_BYTES = 128 << 20
_WRAPPERS: dict[tuple, "_Plan"] = {}


class _Plan:
    def __init__(self, wrapper, refs, key, keyword_api):
        self.wrapper, self.refs, self.key, self.keyword_api = wrapper, refs, key, keyword_api

    def valid_for(self, tensors, key) -> bool:
        return key == self.key and all(r() is t for r, t in zip(self.refs, tensors))


def _backend_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "fa2"
    major, _ = torch.cuda.get_device_capability(device)
    return "fa3" if major == 9 else "fa2"


def plan_for(q_dtype, kv_dtype, device, seqlens, block_table, qo_indptr, num_heads, page_size, causal,
             sm_scale) -> _Plan:
    """The planned wrapper for this step (re-planned when any step tensor changed).

    seqlens [B] int32, block_table [B, max_pages] int32 and qo_indptr [B + 1] int32 are the step's metadata
    (device tensors); the plan copies them to the host once."""
    import flashinfer.mla as fmla
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    tensors = (seqlens, block_table, qo_indptr)
    key = (tuple(t.data_ptr() for t in tensors), tuple(t._version for t in tensors),
           tuple(tuple(t.shape) for t in tensors), num_heads, page_size, causal, sm_scale, q_dtype, kv_dtype)
    slot = (device, q_dtype, kv_dtype)
    cached = _WRAPPERS.get(slot)
    if cached is not None and cached.valid_for(tensors, key):
        return cached
    if cached is not None:
        wrapper = cached.wrapper
    else:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrapper = BatchMLAPagedAttentionWrapper(ws, backend=_backend_name(device))
    kv_indptr, kv_indices = _csr_pages(block_table, seqlens, page_size)
    metadata_cls = getattr(fmla, "MLAPlanMetadata", None)
    _plan_wrapper(wrapper, metadata_cls, qo_indptr, kv_indptr, kv_indices, seqlens, num_heads, page_size, causal,
                  sm_scale, q_dtype, kv_dtype)
    plan = _WRAPPERS[slot] = _Plan(wrapper, tuple(weakref.ref(t) for t in tensors), key, metadata_cls is not None)
    return plan


def _plan_wrapper(wrapper, metadata_cls, qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size, causal,
                  sm_scale, q_dtype, kv_dtype) -> None:
    """wrapper.plan in the API generation this flashinfer speaks: with `metadata_cls` (flashinfer.mla.MLAPlanMetadata,
    0.7 on) canonical CSR metadata by keyword, packed query and cache, natural-log LSE, fp8 as kv-per-tensor; else the
    flat positional plan (no fp8). qo_indptr [B + 1], kv_indptr [B + 1], kv_indices [Σ pages], kv_len [B]: int32."""
    if metadata_cls is not None:
        fp8 = dict(scale_mode="kv-per-tensor") if kv_dtype == FP8 else {}
        wrapper.plan(metadata=metadata_cls.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
                     num_heads=num_heads, head_dim_ckv=512, head_dim_kpe=64, page_size=page_size, causal=causal,
                     sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype, query_layout="packed",
                     kv_cache_layout="packed", lse_mode="basee", **fp8)
    elif kv_dtype == FP8:
        raise RuntimeError("flashinfer takes an fp8 MLA cache from release 0.7 (MLAPlanMetadata) on; this one is "
                           "older: upgrade flashinfer-python or use another backend for fp8 pools")
    else:
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, 512, 64, page_size, causal, sm_scale,
                     q_dtype, kv_dtype)


def _scatter_pages(block_table: torch.Tensor, seqlens: torch.Tensor, page_size: int, out: torch.Tensor,
                   cols: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence b's first ceil(seqlens[b] / page_size) entries of block_table [B, max_pages] int32, in order, into
    out[: Σ pages] (int32, at least B · max_pages + 1 long; unused table entries go to its last element). Fixed
    shapes, no host sync (graph-safe). cols: arange(max_pages) int64 on the device, if cached. Returns the pages
    per sequence, [B] int64."""
    max_pages = block_table.shape[1]
    pages = torch.clamp((seqlens.to(torch.int64) + page_size - 1) // page_size, 0, max_pages)
    start = torch.cumsum(pages, 0) - pages
    cols = (torch.arange(max_pages, device=block_table.device) if cols is None else cols)[None, :]
    dest = torch.where(cols < pages[:, None], start[:, None] + cols, out.numel() - 1)
    out.scatter_(0, dest.reshape(-1), block_table.reshape(-1).to(torch.int32))
    return pages


def _csr_pages(block_table: torch.Tensor, seqlens: torch.Tensor, page_size: int):
    """block_table [B, max_pages] int32, seqlens [B] int32 → (kv_indptr [B + 1] int32, kv_indices [Σ pages] int32):
    sequence b's first ceil(seqlens[b] / page_size) pages, in order (one device sync, as the plan has anyway)."""
    B, max_pages = block_table.shape
    out = torch.empty(B * max_pages + 1, dtype=torch.int32, device=block_table.device)
    pages = _scatter_pages(block_table, seqlens, page_size, out)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=block_table.device)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    return kv_indptr, out[:int(kv_indptr[-1])]


def _run(plan: _Plan, q3, kv_cache, kv_scale=None):
    """q3 [n, H, 576] and kv_cache [pages, page, 576] (bf16 | fp16, or float8_e4m3fn with kv_scale, the per-tensor
    dequantisation scale as a float) → (out [n, H, 512], lse [n, H] fp32, natural log)."""
    wrapper = plan.wrapper
    if plan.keyword_api:
        scales = {} if kv_scale is None else dict(ckv_scale=kv_scale, kpe_scale=kv_scale)
        return wrapper.run(query=q3, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True, **scales)
    q_nope, q_pe = q3[..., :512], q3[..., 512:]
    ckv, kpe = kv_cache[..., :512], kv_cache[..., 512:]
    params = inspect.signature(wrapper.run).parameters
    if "return_lse_base_on_e" in params:
        out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
        return out, lse
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    return out, lse * math.log(2.0)  # older releases return log2


# fp8 pools (e4m3 bytes + one kv_scale): flashinfer ≥ 0.7 on sm90, bf16 queries; taken for them only when named or
# when a tuned store chose it (1.7–5.3× slower than pdlab's fp8 kernels on H200: auto_kv_dtypes)
_OPTIONS = {"page_sizes": tuple(1 << i for i in range(8)), "kv_dtypes": ("bf16", "fp16", "fp8"),
            "q_dtypes": ("bf16", "fp16"), "host_plan": True, "kv_dtype_archs": {"fp8": ("sm90",)},
            "auto_kv_dtypes": ("bf16", "fp16")}
FP8 = torch.float8_e4m3fn
_SCALES: dict[int, tuple] = {}


def _fp8_view(q, kv_cache, kv_scale):
    """(kv_cache as float8_e4m3fn, kv_scale as a float) for a uint8 pool, else (kv_cache, None). A kv_scale tensor
    is read on the host once per tensor and version (a CUDA graph of one step captures after the eager calls)."""
    if kv_cache.dtype != torch.uint8:
        return kv_cache, None
    if q.dtype != torch.bfloat16:
        raise ValueError(f"flashinfer reads an fp8 cache with bf16 queries only, got {q.dtype}: use another backend")
    if isinstance(kv_scale, torch.Tensor):
        hit = _SCALES.get(id(kv_scale))
        if hit is None or hit[0]() is not kv_scale or hit[1] != kv_scale._version:
            if len(_SCALES) > 64:  # a pool keeps one scale tensor: many mean short-lived ones
                _SCALES.clear()
            hit = _SCALES[id(kv_scale)] = (weakref.ref(kv_scale), kv_scale._version, float(kv_scale.reshape(-1)[0]))
        scale = hit[2]
    else:
        scale = 1.0 if kv_scale is None else float(kv_scale)
    return kv_cache.view(FP8), scale


_UNIFORM_QO: dict[tuple, torch.Tensor] = {}


@register_backend("mla_decode", "flashinfer", archs=("cuda",), packages=("flashinfer",), priority=80,
                  options={**_OPTIONS, "q_lens": (1, 2, 4), "graph_replan": True})
def mla_decode_flashinfer(q, kv_cache, block_table, seqlens, softmax_scale, *, kv_scale=None, config=None):
    """BatchMLAPagedAttentionWrapper decode: S_q tokens per request, causal among them when S_q > 1. Inside a
    replayed-graph capture that knows its host lengths, flashinfer's CUDA-graph mode (`_GraphPlan`)."""
    from pdlab.attention.ops import current_replayed_capture

    B, Sq, H, _ = q.shape
    kv_cache, scale = _fp8_view(q, kv_cache, kv_scale)
    cap = current_replayed_capture()
    if cap is not None:
        plan = graph_plan_for(cap, q.dtype, kv_cache.dtype, q.device, B, Sq, H, block_table.shape[1],
                              kv_cache.shape[1], softmax_scale)
        plan.fill_pages(block_table, seqlens, cap)
    else:
        key = (q.device, B, Sq)
        qo = _UNIFORM_QO.get(key)
        if qo is None:
            qo = _UNIFORM_QO[key] = torch.arange(B + 1, dtype=torch.int32, device=q.device) * Sq
        plan = plan_for(q.dtype, kv_cache.dtype, q.device, seqlens, block_table, qo, H, kv_cache.shape[1], Sq > 1,
                        softmax_scale)
    out, lse = _run(plan, q.reshape(B * Sq, H, 576), kv_cache, scale)
    return out.view(B, Sq, H, 512), lse.view(B, Sq, H).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# decode in replayed CUDA graphs

_GRAPH_PLANS: dict[tuple, "_GraphPlan"] = {}
_GRAPH_WORKSPACES: dict[torch.device, torch.Tensor] = {}


class _GraphPlan:
    """A wrapper in flashinfer's CUDA-graph mode for one captured decode shape: batch B, S_q, heads, block-table
    width, page size, dtypes and scale. Its CSR metadata sits in fixed int32 buffers (qo_indptr [B + 1],
    kv_indptr [B + 1], kv_len [B], kv_indices [B · max_pages + 1], the last entry a sink for unused table
    entries) and its schedule in a fixed integer workspace, so a graph captured around `run` replays whatever the
    last `plan` wrote. The graphs on one device share one float workspace (one replays at a time, in stream
    order)."""

    def __init__(self, fmla, device, B, Sq, H, max_pages, page, q_dtype, kv_dtype, sm_scale):
        self.B, self.Sq, self.H, self.max_pages, self.page = B, Sq, H, max_pages, page
        self.q_dtype, self.kv_dtype, self.sm_scale = q_dtype, kv_dtype, sm_scale
        i32 = dict(dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(B + 1, **i32) * Sq
        self.kv_indptr = torch.zeros(B + 1, **i32)
        self.kv_len = torch.ones(B, **i32)
        self.kv_indices = torch.zeros(B * max_pages + 1, **i32)
        self._cols = torch.arange(max_pages, dtype=torch.int64, device=device)
        self._pin = device.type == "cuda"
        self.qo_host = self.qo_indptr.cpu()
        if self._pin:
            self.qo_host = self.qo_host.pin_memory()  # a non_blocking copy source each plan: never modified
        ws = _GRAPH_WORKSPACES.get(device)
        if ws is None:
            ws = _GRAPH_WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = fmla.BatchMLAPagedAttentionWrapper(
            ws, use_cuda_graph=True, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
            kv_len_arr=self.kv_len, backend=_backend_name(device))
        self._metadata_cls = getattr(fmla, "MLAPlanMetadata", None)
        self.keyword_api = self._metadata_cls is not None
        self.plan_info = None
        self._fast: tuple | None = None  # `_fast_parts`, once the wrapper has planned
        self._filled: tuple | None = None

    def plan(self, seqlens: torch.Tensor) -> None:
        """Plan the step's lengths, seqlens [B] int32 on the host (every row the graph runs, padding included):
        host work and non-blocking copies into the fixed buffers, no device sync. Raises if flashinfer's plan
        info (what the captured launch holds) differs from the capture's."""
        if seqlens.device.type != "cpu" or tuple(seqlens.shape) != (self.B,):
            raise ValueError(f"a flashinfer graph plan takes the step's [B={self.B}] int32 lengths on the host, got "
                             f"{tuple(seqlens.shape)} on {seqlens.device}")
        lens_np = seqlens.numpy().astype(np.int64)
        pages = (lens_np + self.page - 1) // self.page
        if self.B and (int(pages.max()) > self.max_pages or int(lens_np.min()) < self.Sq):
            raise ValueError(f"lengths {lens_np.tolist()[:8]}... do not fit the captured decode shape: 1 <= pages <= "
                             f"{self.max_pages} of {self.page} tokens and at least S_q={self.Sq} tokens per row")
        # [kv_indptr (B + 1) | kv_len (B)] in one host tensor, pinned where the copies into the fixed buffers are
        # asynchronous (a fresh one per plan: a replay queued behind may still read the last one's copy)
        host = torch.empty(2 * self.B + 1, dtype=torch.int32, pin_memory=self._pin)
        h = host.numpy()
        h[0] = 0
        h[1:self.B + 1] = np.cumsum(pages)
        h[self.B + 1:] = lens_np
        kv_indptr, lens = host[:self.B + 1], host[self.B + 1:]
        if self._fast is not None:
            self._fast_plan(kv_indptr, lens)
            return
        kv_indices = self.kv_indices[:int(h[self.B])]  # written by the graph itself (`fill_pages`)
        _plan_wrapper(self.wrapper, self._metadata_cls, self.qo_host, kv_indptr, kv_indices, lens, self.H, self.page,
                      self.Sq > 1, self.sm_scale, self.q_dtype, self.kv_dtype)
        self._check_info(_plan_info(self.wrapper))
        self._fast = self._fast_parts()

    def _fast_parts(self) -> tuple | None:
        """What a re-plan below the wrapper needs, found once after the wrapper's plan: (planned backend, its
        compiled plan or None, its module wrapper's plan), or None where this release exposes neither (or keeps
        no plan info to check), or where the batch could reach the scheduler's 16384 work items (at most one per 64
        query rows of each request plus one per cluster): then every re-plan goes through the wrapper."""
        be = getattr(self.wrapper, "_planned_backend", None)
        gen = getattr(be, "_cached_module", None)
        raw = getattr(getattr(gen, "_module", None), "plan", None)
        staged_fn = getattr(gen, "plan_with_staged_workspace_bytes", None)
        parts = ("_float_workspace_buffer", "_int_workspace_buffer", "_pin_memory_int_workspace_buffer")
        if (raw is None and staged_fn is None) or not all(hasattr(be, a) for a in parts) or self.plan_info is None:
            return None
        if self.B * -(-self.Sq * self.H // 64) + 1024 > 16384:
            return None
        return be, raw, staged_fn

    def _fast_plan(self, kv_indptr: torch.Tensor, lens: torch.Tensor) -> None:
        """A re-plan below the wrapper, whose checks cost about a millisecond of host time per step: the planned
        backend's compiled plan writes the schedule into a pinned buffer of a small ring (`_pinned_slot`) and its
        staged bytes go to the integer workspace by one asynchronous copy (flashinfer's own module wrapper copies
        them into a fresh pinned buffer first, on the host; used where a release exposes only that), then
        kv_indptr [B + 1] and kv_len [B] (int32 host) go into the fixed buffers."""
        be, raw, staged_fn = self._fast
        args = (self.qo_host, kv_indptr, lens, self.H, 512, self.Sq > 1)
        if raw is not None:
            iws = be._int_workspace_buffer
            slot, done = _pinned_slot(iws)
            info, staged = raw(be._float_workspace_buffer, iws, slot, *args)
            staged = int(staged)
            if not 0 <= staged <= iws.numel() * iws.element_size():
                raise RuntimeError(f"flashinfer's MLA plan staged {staged} bytes for an integer workspace of "
                                   f"{iws.numel() * iws.element_size()}")
            iws.view(torch.uint8)[:staged].copy_(slot.view(torch.uint8)[:staged], non_blocking=True)
            if done is not None:
                done.record()
        else:
            info, _ = staged_fn(be._float_workspace_buffer, be._int_workspace_buffer,
                                be._pin_memory_int_workspace_buffer, *args)
        self.kv_indptr.copy_(kv_indptr, non_blocking=True)
        self.kv_len.copy_(lens, non_blocking=True)
        be._plan_info = info
        self._check_info(tuple(int(x) for x in info))

    def _check_info(self, info: tuple | None) -> None:
        if self.plan_info is None:
            self.plan_info = info
        elif info != self.plan_info:
            raise RuntimeError(f"flashinfer's plan info changed between plans of one captured decode shape "
                               f"({self.plan_info} -> {info}): the graph holds the first launch, so replaying it would "
                               "run a stale schedule. Serve with --disable-cuda-graph or another attention backend.")

    def fill_pages(self, block_table: torch.Tensor, seqlens: torch.Tensor, cap=None) -> None:
        """The step's page ids, in CSR order, into kv_indices: row b's first ceil(seqlens[b] / page) entries of
        block_table [B, max_pages] int32 at offset Σ_{b' < b} pages (what `plan` puts in kv_indptr from the same
        lengths on the host), from seqlens [B] int32. Device work of fixed shapes (graph-safe); once per step,
        however many layers call: skipped when these tensors, unchanged, were filled in the same capture `cap`
        and the same mode (a fill run eagerly is not in the graph being captured)."""
        capturing = block_table.is_cuda and torch.cuda.is_current_stream_capturing()
        f = self._filled
        if f is not None and f[0]() is block_table and f[1]() is seqlens and f[2] == (
                block_table._version, seqlens._version) and f[3]() is cap and f[4] == capturing:
            return
        _scatter_pages(block_table, seqlens, self.page, self.kv_indices, self._cols)
        self._filled = (weakref.ref(block_table), weakref.ref(seqlens), (block_table._version, seqlens._version),
                        weakref.ref(cap) if cap is not None else (lambda: None), capturing)


_PINNED_RINGS: dict[tuple, list] = {}
RING_SLOTS = 3


def _pinned_slot(like: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """The next buffer of a ring (per device and size) of RING_SLOTS host buffers shaped like `like` (pinned on a
    GPU), once the copy last queued from it has run, with the event to record after the next one (None on CPU).
    Re-plans run one after another on the host, so 3 slots leave two plans' copies in flight before a wait."""
    key = (like.device, like.dtype, like.numel())
    ring = _PINNED_RINGS.get(key)
    if ring is None:
        cuda = like.device.type == "cuda"
        ring = _PINNED_RINGS[key] = [0] + [
            (torch.empty(like.numel(), dtype=like.dtype, pin_memory=cuda), torch.cuda.Event() if cuda else None)
            for _ in range(RING_SLOTS)]
    ring[0] = i = ring[0] % RING_SLOTS + 1
    buf, event = ring[i]
    if event is not None:
        event.synchronize()  # long done unless the GPU lags the host by RING_SLOTS steps
    return buf, event


def _plan_info(wrapper) -> tuple | None:
    """flashinfer's plan info of the wrapper's last plan (0.7: on the planned backend; older: on the wrapper) as a
    tuple of ints, or None where this release keeps it elsewhere."""
    info = getattr(getattr(wrapper, "_planned_backend", None), "_plan_info", None)
    if info is None:
        info = getattr(wrapper, "_plan_info", None)
    try:
        return None if info is None else tuple(int(x) for x in info)
    except TypeError:
        return None


def graph_plan_for(cap, q_dtype, kv_dtype, device, B, Sq, H, max_pages, page_size, sm_scale) -> _GraphPlan:
    """The graph-mode plan of this decode shape, planned for the capture's host lengths the first time the capture
    `cap` (a `pdlab.attention.ops.ReplayedCapture`) meets it and registered there for its re-plans."""
    import flashinfer.mla as fmla

    if not cap.can_replan:
        raise RuntimeError("flashinfer decode in a replayed CUDA graph needs the capture's host lengths: capture "
                           "under replayed_graph_capture(seqlens)")
    key = (device, B, Sq, H, max_pages, page_size, q_dtype, kv_dtype, sm_scale)
    plan = _GRAPH_PLANS.get(key)
    if plan is None:
        plan = _GRAPH_PLANS[key] = _GraphPlan(fmla, device, B, Sq, H, max_pages, page_size, q_dtype, kv_dtype,
                                              sm_scale)
    if cap.register(plan, plan.plan):
        plan.plan(cap.seqlens)
    return plan


@register_backend("mla_prefill", "flashinfer", archs=("cuda",), packages=("flashinfer",), priority=80,
                  options=_OPTIONS)
def mla_prefill_flashinfer(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, *, kv_scale=None,
                           max_q_len=None, config=None):
    """BatchMLAPagedAttentionWrapper causal extend over the paged cache (ragged); a batch over the scheduler's
    capacity runs in parts (`_prefill_in_parts`)."""
    fp8_cache, scale = _fp8_view(q, kv_cache, kv_scale)
    try:
        plan = plan_for(q.dtype, fp8_cache.dtype, q.device, seqlens, block_table, qo_indptr, q.shape[1],
                        kv_cache.shape[1], True, softmax_scale)
    except Exception as exc:  # flashinfer's own error type is private: recognised by its message
        if "work items" not in str(exc) or q.shape[0] < 2:
            raise
        return _prefill_in_parts(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, kv_scale)
    return _run(plan, q, fp8_cache, scale)


def _prefill_in_parts(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, kv_scale=None):
    """The extend of q [T, H, 576] as two calls over query rows [0, T/2) and [T/2, T) (each may split again).
    A part holding rows r0 … r1 - 1 of sequence b (n_b new rows, seqlens[b] tokens in all) attends to its first
    seqlens[b] - (n_b - r1) tokens, causally: the same rows of the same result. Returns (out [T, H, 512],
    lse [T, H] fp32)."""
    qo, lens = qo_indptr.tolist(), seqlens.tolist()
    T = qo[-1]
    outs, lses = [], []
    for a, b in ((0, T // 2), (T // 2, T)):
        rows, kv_lens, counts = [], [], []
        for s, (lo, hi) in enumerate(zip(qo[:-1], qo[1:])):
            r0, r1 = max(a, lo), min(b, hi)
            if r0 < r1:
                rows.append(s)
                counts.append(r1 - r0)
                kv_lens.append(lens[s] - (hi - r1))
        dev = q.device
        part_qo = torch.tensor([0] + counts, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
        part_lens = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        part_table = block_table[torch.tensor(rows, dtype=torch.int64, device=dev)]
        out, lse = mla_prefill_flashinfer(q[a:b], kv_cache, part_table, part_lens, part_qo, softmax_scale,
                                          kv_scale=kv_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
