"""Dispatch-output layouts: what the expert runners consume and what dispatch produces.

Two layouts, each carrying one payload kind:

- `Contiguous` (normal-mode dispatch, prefill): hidden 2-D ``[N, K]`` with the rows of local expert
  e at ``offsets[e]:offsets[e+1]``; ``counts [E]`` int32, ``offsets [E+1]`` int32.
- `Masked` (low-latency dispatch, decode): hidden 3-D ``[E, M_max, K]``; rows ``m >= masked_m[e]``
  of expert e are garbage (never read).

Payloads (K = the logical hidden size):

- ``bf16``: hidden bf16 (fp16 / fp32 are accepted too, for CPU tests) ``[.., K]``.
- ``fp8``: hidden float8_e4m3fn ``[.., K]`` + scales fp32 ``[.., K/128]`` (value = fp8 · scale).
- ``nvfp4``: hidden uint8 ``[.., K/2]`` (E2M1 pairs, low nibble even) + scales float8_e4m3fn
  ``[.., K/16]`` + global_scale fp32 scalar or ``[E]`` (value = e2m1 · scale / global_scale).

`group_tokens` and `to_masked` are the single-rank building blocks of dispatch: pure layout
functions, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from pdlab.kernels.contracts import Op, ShapeError, Spec, describe_tensor, dtype_name
from pdlab.kernels import nvfp4 as _nvfp4

PAYLOADS = ("bf16", "fp8", "nvfp4")
LAYOUTS = ("contiguous", "masked")
FP8_BLOCK = 128

_CONTIG_HINT = ("A 3-D input comes from low-latency dispatch (Masked layout): use normal-mode dispatch "
                "with this runner, or a runner that accepts the masked layout.")
_MASKED_HINT = ("A 2-D input comes from normal-mode dispatch (Contiguous layout): use low-latency "
                "dispatch with this runner, or a runner that accepts the contiguous layout.")


def _hidden_spec(layout: str, payload: str) -> Spec:
    lead = "N" if layout == "contiguous" else "E M"
    if payload == "bf16":
        return Spec(f"{lead} K", "bf16|fp16|fp32", layout=layout, last_dim_contiguous=True)
    if payload == "fp8":
        return Spec(f"{lead} K", "fp8_e4m3", layout=layout, last_dim_contiguous=True)
    if payload == "nvfp4":
        return Spec(f"{lead} K/2", "uint8", layout=layout, last_dim_contiguous=True)
    raise ValueError(f"unknown payload {payload!r}; known: {', '.join(PAYLOADS)}")


def _scales_spec(layout: str, payload: str) -> Spec | None:
    lead = "N" if layout == "contiguous" else "E M"
    if payload == "fp8":
        return Spec(f"{lead} K/128", "fp32", layout=layout, last_dim_contiguous=True)
    if payload == "nvfp4":
        return Spec(f"{lead} K/16", "fp8_e4m3|uint8", layout=layout, last_dim_contiguous=True)
    return None


@lru_cache(maxsize=None)
def layout_op(layout: str, payload: str, op_name: str = "moe_layout") -> Op:
    """The contract of one (layout, payload) pair, under the name of the op that checks it
    (`moe_layout` for `validate()`, `moe_experts` for the runners)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    inputs: dict[str, Spec] = {"hidden": _hidden_spec(layout, payload)}
    scales = _scales_spec(layout, payload)
    if scales is not None:
        inputs["scales"] = scales
    if payload == "nvfp4":
        inputs["global_scale"] = Spec("...", "fp32")
    # the kernels index the bookkeeping densely: a strided view would be read as another tensor
    if layout == "contiguous":
        inputs["counts"] = Spec("E", "int32", contiguous=True)
        inputs["offsets"] = Spec("E1", "int32", contiguous=True)
    else:
        inputs["masked_m"] = Spec("E", "int32", contiguous=True)
    hint = _CONTIG_HINT if layout == "contiguous" else _MASKED_HINT

    def hidden_hint(problem: str, value: object, bound: object) -> str | None:
        if "dims" in problem:
            return hint
        if "dtype" in problem:
            return (f"payload {payload!r} needs that dtype; build the layout with the payload that matches "
                    "the tensor (bf16 → bf16|fp16|fp32, fp8 → float8_e4m3fn, nvfp4 → packed uint8).")
        return None

    return Op(op_name, inputs=inputs, hints={
        "hidden": hidden_hint,
        "scales": f"{payload} payload scales are one per {FP8_BLOCK if payload == 'fp8' else 16} "
                  "elements of K along the last dim.",
        "offsets": "offsets has one more entry than counts: offsets[0] = 0, offsets[e+1] = offsets[e] + counts[e].",
        "global_scale": "nvfp4 global_scale is an fp32 scalar or one value per local expert [E].",
    })


def _check_global_scale(op: Op, backend: str | None, gs: torch.Tensor | None, num_experts: int,
                        device: torch.device) -> None:
    if gs is None:
        op.require(backend, False, "global_scale", "is required for the nvfp4 payload", gs,
                   "fp32 scalar or [E]", "pass the activation global scale (448·6/amax = 1/input_scale).")
    op.require(backend, isinstance(gs, torch.Tensor) and gs.dtype == torch.float32, "global_scale",
               "must be an fp32 tensor", gs, f"fp32 scalar or [{num_experts}]",
               "pass torch.tensor(scale, dtype=torch.float32, device=hidden.device)")
    ok = gs.dim() == 0 or (gs.dim() == 1 and gs.shape[0] in (1, num_experts))
    op.require(backend, ok, "global_scale", "has the wrong shape", gs, f"fp32 scalar or [{num_experts}]")
    op.require(backend, gs.device == device, "global_scale", f"is on {gs.device} while hidden is on {device}", gs,
               f"fp32 scalar or [{num_experts}] on {device}", "move it to the hidden states' device")


class _PayloadFields:
    """What both layouts share: the payload's tensors and the model's hidden size."""

    @property
    def hidden_size(self) -> int:
        return self.hidden.shape[-1] * (2 if self.payload == "nvfp4" else 1)

    def _with_payload(self, out: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        if self.payload != "bf16":
            out["scales"] = self.scales
        if self.payload == "nvfp4":
            out["global_scale"] = self.global_scale
        return out


@dataclass(frozen=True)
class Contiguous(_PayloadFields):
    """Rows grouped by local expert (normal-mode dispatch output).

    hidden: [N, K] bf16|fp16|fp32 | [N, K] float8_e4m3fn | [N, K/2] uint8 (nvfp4), rows of expert e at
        offsets[e]:offsets[e+1] (rows past offsets[E] are padding, never read).
    counts: [E] int32. offsets: [E+1] int32, offsets[0] = 0 (cumulative counts).
    payload: "bf16" | "fp8" | "nvfp4". scales: fp8 [N, K/128] fp32 | nvfp4 [N, K/16] float8_e4m3fn.
    global_scale: nvfp4 only, fp32 scalar or [E]. offsets_cpu: optional host copy of offsets.
    """

    hidden: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    payload: str = "bf16"
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    offsets_cpu: tuple[int, ...] | None = None

    kind = "contiguous"

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The layout's tensors by contract name: hidden [N, K] (bf16; uint8 [N, K/2] nvfp4, fp8 [N, K]), counts [E]
        int32, offsets [E + 1] int32, and the payload's scales where it has them."""
        return self._with_payload({"hidden": self.hidden, "counts": self.counts, "offsets": self.offsets})

    def validate(self, op_name: str = "moe_layout", backend: str | None = None) -> dict[str, int]:
        """Check shapes/dtypes against the contract (no device sync); returns the bound dims
        (N, K, E). Raises ShapeError."""
        op = layout_op("contiguous", self.payload, op_name)
        t = self.tensors()
        gs = t.pop("global_scale", None)
        dims = op.check(backend, **t)
        op.require(backend, self.offsets.shape[0] == dims["E"] + 1, "offsets", "must have E+1 entries",
                   self.offsets, f"[{dims['E'] + 1}] int32")
        if self.payload == "nvfp4":
            _check_global_scale(op, backend, gs, dims["E"], self.hidden.device)
        return dims

    def check_rows(self, op_name: str = "moe_layout", backend: str | None = None) -> None:
        """`validate`, then the row counts the contract cannot check (one host sync): counts[e] >= 0,
        offsets[0] = 0, offsets[e+1] - offsets[e] = counts[e] and offsets[E] <= N, the rows of hidden. Raises
        ShapeError naming the first expert that breaks one; a kernel handed such counts would read or write rows of
        another expert or past the tensor. (`run_experts` calls it under PDLAB_CHECK_INVARIANTS=1; the torch runner
        always.)"""
        self.validate(op_name, backend)  # shapes first: offsets has E+1 entries
        counts = self.counts.tolist()
        offsets = self.offsets.tolist()
        n = self.hidden.shape[0]
        bad = next((e for e, c in enumerate(counts) if c < 0 or offsets[e + 1] - offsets[e] != c), None)
        if offsets[:1] != [0] or bad is not None:
            e = 0 if bad is None else bad
            raise ShapeError(op_name, backend, "offsets", "does not accumulate counts",
                             "offsets[0] = 0, offsets[e+1] = offsets[e] + counts[e], counts[e] >= 0",
                             f"counts[{e}] = {counts[e]}, offsets[{e}:{e + 2}] = {offsets[e:e + 2]}",
                             "build the layout with group_tokens or take it from dispatch()")
        if offsets[-1] > n:
            raise ShapeError(op_name, backend, "counts", "holds more rows than hidden",
                             f"sum(counts) <= {n} (the rows of hidden)", f"sum(counts) = {offsets[-1]}",
                             "hidden must hold every counted row")


@dataclass(frozen=True)
class Masked(_PayloadFields):
    """Rows per local expert in a fixed-size slab (low-latency dispatch output).

    hidden: [E, M_max, K] bf16|fp16|fp32 | float8_e4m3fn | [E, M_max, K/2] uint8 (nvfp4); rows
        m >= masked_m[e] are never read. masked_m: [E] int32 (valid rows per expert, <= M_max).
    payload / scales ([E, M_max, K/128] fp32 or [E, M_max, K/16] e4m3) / global_scale as Contiguous.
    max_rows: an upper bound of sum(masked_m) known to the producer without reading masked_m (low-latency
        dispatch: the tokens it can receive times top-k), or None (E·M_max). Kernels size their grids
        by it instead of by the slab; a sum above it is an error of the producer (rows past the bound are not
        computed).
    """

    hidden: torch.Tensor
    masked_m: torch.Tensor
    payload: str = "bf16"
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int)
                                          or self.max_rows < 0):
            raise ValueError(f"Masked: max_rows={self.max_rows!r} must be None or an int >= 0 (an upper bound of "
                             "sum(masked_m), e.g. tokens received × top-k)")

    kind = "masked"

    @property
    def num_experts(self) -> int:
        return self.masked_m.shape[0]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The layout's tensors by contract name: masked_m [E] int32, hidden [E, M, K] (bf16; uint8 [E, M, K/2]
        nvfp4, fp8 [E, M, K]), and the payload's scales where it has them."""
        return self._with_payload({"masked_m": self.masked_m, "hidden": self.hidden})

    def validate(self, op_name: str = "moe_layout", backend: str | None = None) -> dict[str, int]:
        """Check shapes/dtypes against the contract (no device sync); returns bound dims (E, M, K).
        Raises ShapeError (a 2-D hidden gets the normal-vs-low-latency hint)."""
        op = layout_op("masked", self.payload, op_name)
        t = self.tensors()
        gs = t.pop("global_scale", None)
        dims = op.check(backend, **t)
        if self.payload == "nvfp4":
            _check_global_scale(op, backend, gs, dims["E"], self.hidden.device)
        return dims

    def check_rows(self, op_name: str = "moe_layout", backend: str | None = None) -> None:
        """`validate`, then the row counts the contract cannot check (one host sync): 0 <= masked_m[e] <= M_max,
        and sum(masked_m) <= max_rows where the producer bounded it. Raises ShapeError naming the first expert that
        breaks one: a kernel handed a count above the slab reads and writes the next expert's rows (or past the
        tensor), and one whose sum exceeds max_rows leaves the rows past the bound unwritten. (`run_experts` calls
        it under PDLAB_CHECK_INVARIANTS=1; the torch runner always.)"""
        self.validate(op_name, backend)  # shapes first: hidden is [E, M, K]
        m = self.masked_m.tolist()
        m_max = self.hidden.shape[1]
        bad = next((e for e, c in enumerate(m) if not 0 <= c <= m_max), None)
        if bad is not None:
            raise ShapeError(op_name, backend, "masked_m", "counts rows the slab does not have",
                             f"0 <= masked_m[e] <= {m_max} (the slab's M)", f"masked_m[{bad}] = {m[bad]}",
                             "size the slab by the most rows one expert can receive (num_max_dispatch_tokens_per_rank "
                             "× ranks)")
        total = sum(m)
        if self.max_rows is not None and total > self.max_rows:
            raise ShapeError(op_name, backend, "masked_m", "sums above the layout's max_rows",
                             f"sum(masked_m) <= max_rows = {self.max_rows}", f"sum(masked_m) = {total}",
                             "max_rows must bound the rows received (tokens × top-k), or be None: kernels size "
                             "their grids by it and would leave the rows past it unwritten")


Layout = Contiguous | Masked


@dataclass(frozen=True)
class GroupInfo:
    """How `group_tokens` permuted the (token, slot) pairs.

    src_token: [N] int64, the token each grouped row came from. src_slot: [N] int64, its top-k slot.
    row_of: [T, k] int64, the grouped row of each (token, slot), -1 where the expert is not local.
    """

    src_token: torch.Tensor
    src_slot: torch.Tensor
    row_of: torch.Tensor
    num_tokens: int


def infer_payload(hidden: torch.Tensor) -> str:
    """The payload kind of a layout's hidden ([N, K] or [E, M, K]; [.., K/2] for nvfp4): "nvfp4" for uint8, "fp8"
    for float8_e4m3fn, else "bf16"."""
    if hidden.dtype == torch.uint8:
        return "nvfp4"
    if hidden.dtype == getattr(torch, "float8_e4m3fn", None):
        return "fp8"
    return "bf16"


def group_tokens(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, expert_start: int = 0,
                 scales: torch.Tensor | None = None, global_scale: torch.Tensor | None = None,
                 payload: str | None = None, num_rows: int | None = None) -> tuple[Contiguous, GroupInfo]:
    """Group each (token, slot) pair by its expert (one rank, no communication).

    Args:
        x: [T, K] bf16|fp16|fp32, or [T, K] fp8 / [T, K/2] uint8 (nvfp4) with `scales`.
        topk_ids: [T, k] int32|int64 global expert ids; ids outside
            [expert_start, expert_start + num_experts) are not local and are dropped.
        num_experts: local expert count E. expert_start: first local expert id.
        scales: fp8 [T, K/128] fp32 | nvfp4 [T, K/16] e4m3. global_scale: nvfp4 fp32 scalar or [E].
        num_rows: host-known row count N of the layout, at least the local pairs (T·k always is): no host sync.
            Rows past offsets[E] then hold the dropped pairs (padding the experts never read; their row_of is -1).
            None: N = the number of local pairs, read back once (a host sync).
    Returns:
        (Contiguous [N, K(/2)], rows ordered by expert then token (stable); GroupInfo to scatter results back).
    """
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ShapeError("group_tokens", None, "x/topk_ids", "must be [T, K] and [T, k] with the same T",
                         "x [T, K], topk_ids [T, k]", f"x {describe_tensor(x)}, topk_ids {describe_tensor(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ShapeError("group_tokens", None, "topk_ids", f"has dtype {dtype_name(topk_ids.dtype)}",
                         "[T, k] int32|int64", describe_tensor(topk_ids),
                         "expert ids are integers: pass the router's ids (a float tensor would be truncated)")
    payload = payload or infer_payload(x)
    T, k = topk_ids.shape
    local = topk_ids.long() - expert_start
    valid = (local >= 0) & (local < num_experts)
    key = torch.where(valid, local, torch.full_like(local, num_experts)).flatten()
    order = torch.sort(key, stable=True).indices
    # scatter_add, not bincount: bincount on CUDA reads max(key) back to the host (a sync)
    counts_all = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))
    counts = counts_all[:num_experts].to(torch.int32)
    if num_rows is None:
        n = int(counts.sum())
    elif not T * k >= num_rows >= 0:
        raise ValueError(f"group_tokens: num_rows={num_rows} must lie in 0..T·k={T * k} (T·k always holds the "
                         "local pairs; None reads their count back)")
    else:
        n = num_rows
    order = order[:n]
    src_token = order // k
    src_slot = order % k
    row_of = torch.full((T * k,), -1, dtype=torch.long, device=x.device)
    rows = torch.arange(n, device=x.device)
    row_of[order] = rows if num_rows is None else torch.where(key[order] < num_experts, rows, -1)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    layout = Contiguous(x[src_token], counts, offsets, payload,
                        scales[src_token] if scales is not None else None, global_scale)
    return layout, GroupInfo(src_token, src_slot, row_of.view(T, k), T)


def to_masked(layout: Contiguous, max_m: int | None = None, fill: float | None = None) -> Masked:
    """Scatter a Contiguous layout into the Masked slab.

    max_m: M_max (default: max(counts), one sync). Experts with more rows than max_m raise ValueError.
    fill: value written into rows >= masked_m (default zeros; tests pass NaN to prove they are
    never read; bytes for fp8/nvfp4 are filled with 0xFF = NaN / -6 pattern).
    Returns Masked(hidden [E, max_m, K(/2)], masked_m = counts, max_rows = the row count), same payload, scales
    likewise.
    """
    E = layout.num_experts
    counts = layout.counts
    if max_m is None:
        max_m = int(counts.max()) if E else 0
    elif E and bool((counts > max_m).any()):
        raise ValueError(f"to_masked: an expert has {int(counts.max())} rows but max_m={max_m}; "
                         "raise num_max_dispatch_tokens_per_rank / max_m")
    n = layout.offsets.long()
    rows = torch.arange(layout.hidden.shape[0], device=layout.hidden.device)
    n_rows = int(n[-1]) if E else 0
    rows = rows[:n_rows]
    expert = torch.searchsorted(n[1:], rows, right=True)
    pos = rows - n[expert]

    def scatter(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.empty((E, max_m) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        if fill is None:
            out.zero_()
        elif t.dtype.is_floating_point and t.element_size() > 1:
            out.fill_(fill)
        else:
            out.view(torch.uint8).fill_(0xFF)
        out[expert, pos] = t[:n_rows]
        return out

    return Masked(scatter(layout.hidden), counts.clone(), layout.payload, scatter(layout.scales),
                  layout.global_scale, max_rows=n_rows)


def to_contiguous(layout: Masked) -> Contiguous:
    """Gather the valid rows of a Masked layout into a Contiguous one (syncs once).

    Returns Contiguous(hidden [Σ masked_m, K(/2)], counts = masked_m, offsets = cumsum)."""
    E, M = layout.hidden.shape[:2]
    keep = torch.arange(M, device=layout.hidden.device)[None, :] < layout.masked_m.long()[:, None]
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=layout.hidden.device)
    offsets[1:] = torch.cumsum(layout.masked_m, 0).to(torch.int32)
    hidden = layout.hidden[keep]
    scales = layout.scales[keep] if layout.scales is not None else None
    return Contiguous(hidden, layout.masked_m.to(torch.int32).clone(), offsets, layout.payload, scales,
                      layout.global_scale)


def with_hidden(layout: Layout, hidden: torch.Tensor) -> Layout:
    """The same layout (counts/offsets or masked_m) carrying a new bf16 hidden (e.g. expert output): hidden [N, K]
    bf16 for a contiguous layout, [E, M, K] bf16 for a masked one."""
    return replace(layout, hidden=hidden, payload="bf16", scales=None, global_scale=None)


# ---------------------------------------------------------------------------------------------
# payload helpers


def quantize_fp8_blockwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 128) → (float8_e4m3fn [..., K], fp32 scales [..., K/128]),
    scale = amax/448 per 128 elements (1 where the block is zero)."""
    if x.shape[-1] % FP8_BLOCK:
        raise ValueError(f"fp8 payload needs K a multiple of {FP8_BLOCK}, got K={x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, FP8_BLOCK))
    amax = blocks.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    return q, scale


def quantize_payload(x: torch.Tensor, payload: str, global_scale: torch.Tensor | float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [T, K] bf16 → (hidden, scales, global_scale) for `payload` ("bf16" returns x unchanged).

    nvfp4 needs global_scale (fp32 scalar, the layer's static activation scale 1/input_scale);
    None takes 448·6/amax(x) (one sync)."""
    if payload == "bf16":
        return x, None, None
    if payload == "fp8":
        q, s = quantize_fp8_blockwise(x)
        return q, s, None
    if payload == "nvfp4":
        if global_scale is None:  # amax of no tokens is 0 (scale 1); torch's amax refuses an empty tensor
            amax = x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device)
            global_scale = _nvfp4.global_scale_from_amax(amax)
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        packed, sf = _nvfp4.quantize_nvfp4(x, gs)
        return packed, sf, gs
    raise ValueError(f"unknown payload {payload!r}; known: {', '.join(PAYLOADS)}")


def dequantize_hidden(layout: Layout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layout's hidden as real values: [N, K] or [E, M, K] of `dtype` (rows past the valid ones
    are dequantised too; callers ignore them)."""
    h = layout.hidden
    if layout.payload == "bf16":
        return h.to(dtype)
    if layout.payload == "fp8":
        v = h.float().unflatten(-1, (-1, FP8_BLOCK)) * layout.scales.float().unsqueeze(-1)
        return v.flatten(-2).to(dtype)
    gs = layout.global_scale.float()
    if gs.dim() == 1 and gs.numel() > 1:
        if isinstance(layout, Masked):
            gs = gs  # one per leading expert index
        else:
            expert = torch.repeat_interleave(torch.arange(layout.num_experts, device=h.device),
                                             layout.counts.long(), output_size=None)
            full = torch.ones(h.shape[0], device=h.device)
            full[: expert.numel()] = gs[expert]
            return _nvfp4.dequantize_nvfp4(h, layout.scales, full, dtype)
    elif gs.dim() == 1:
        gs = gs[0]
    return _nvfp4.dequantize_nvfp4(h, layout.scales, gs, dtype)
