"""The dispatcher interface and the pieces every backend shares.

A dispatcher moves each token to the ranks that hold its experts and back::

    layout, handle = dispatcher.dispatch(x, topk_ids, topk_weights, "nvfp4", global_scale=gs)
    y = run_experts(layout, weights)            # same layout, bf16
    out = dispatcher.combine(y, handle)         # [T, H] bf16 = Σ_j w[t, j] · expert_j(x[t])

Mode "normal" gives a `Contiguous` layout (rows grouped by local expert), "low_latency" a `Masked`
one ([E_local, M_max, K] with M_max = num_max_dispatch_tokens_per_rank · world_size). A token bound
for several experts of one rank crosses the link once: the sender de-duplicates per destination
rank and the receiver expands the row to each of its local experts. The combine sums the weighted
expert outputs in fp32: first over the local experts on the receiving rank, then over the ranks
on the sending rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from pdlab.kernels.contracts import Op, ShapeError, Spec, describe_tensor
from pdlab.kernels.env import ENV
from pdlab.kernels.graphs import capturing
from pdlab.kernels.nvfp4 import BLOCK as NVFP4_BLOCK
from pdlab.moe.layouts import FP8_BLOCK, PAYLOADS, Contiguous, Layout, Masked, group_tokens, quantize_fp8_blockwise

MODES = ("normal", "low_latency")
LAYOUT_OF_MODE = {"normal": "contiguous", "low_latency": "masked"}

DISPATCH = Op(
    "moe_dispatch",
    inputs={
        "x": Spec("T H", "bf16|fp16|fp32", last_dim_contiguous=True),
        "topk_ids": Spec("T k", "int32|int64"),
        "topk_weights": Spec("T k", "fp32"),
    },
    hints={
        "x": "dispatch takes the layer's tokens [T, H] (bf16; fp16/fp32 for CPU tests) before quantization.",
        "topk_ids": "topk_ids is the router's [T, top_k] int32 expert ids (global ids, 0..num_experts-1).",
        "topk_weights": "topk_weights is the router's [T, top_k] fp32 weights, same shape as topk_ids.",
    },
)


# ---------------------------------------------------------------------------------------------
# payloads


@dataclass
class TokenPayload:
    """Tokens as they travel, after the (optional) quantize stage.

    kind: "bf16" | "fp8" | "nvfp4".
    data: bf16 [T, H] | float8_e4m3fn [T, H] | uint8 [T, H/2] (e2m1 pairs, low nibble even).
    scales: None | fp32 [T, H/128] (fp8, value = fp8 · scale) | float8_e4m3fn [T, H/16] (nvfp4).
    global_scale: nvfp4 only: fp32 scalar (448·6/amax, the layer's static activation scale).
    source: the bf16 tokens [T, H] it was made from (backends that quantize inside their own
        kernels, e.g. DeepEP low-latency fp8, read this instead of `data`).
    deferred: the backend quantizes inside its dispatch kernel; `data` is then the bf16 source and
        `scales` is None (DeepEP low-latency `quantize`).
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    source: torch.Tensor | None = None
    deferred: bool = False

    @property
    def num_tokens(self) -> int:
        return self.data.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.data.shape[1] * (2 if self.kind == "nvfp4" and not self.deferred else 1)

    def row_bytes(self) -> int:
        """Bytes one token row occupies on the wire (data + scales)."""
        if self.deferred:
            return payload_row_bytes(self.kind, self.hidden_size)
        n = self.data.shape[1] * self.data.element_size()
        if self.scales is not None:
            n += self.scales.shape[1] * self.scales.element_size()
        return n

    def parts(self) -> list[torch.Tensor]:
        """[data] or [data, scales]: the tensors that travel (data bf16 [T, H], float8_e4m3fn [T, H] or uint8
        [T, H/2]; scales fp32 [T, H/128] or float8_e4m3fn [T, H/16], as the payload kind has them)."""
        return [self.data] + ([self.scales] if self.scales is not None else [])


def payload_row_bytes(kind: str, hidden_size: int) -> int:
    """Wire bytes of one token row for a payload kind (bf16 2H, fp8 H + 4H/128, nvfp4 H/2 + H/16)."""
    if kind == "bf16":
        return 2 * hidden_size
    if kind == "fp8":
        return hidden_size + 4 * (hidden_size // 128)
    if kind == "nvfp4":
        return hidden_size // 2 + hidden_size // 16
    raise ValueError(f"unknown payload {kind!r}; known: {', '.join(PAYLOADS)}")


def payload_size_problem(kind: str, hidden_size: int) -> str | None:
    """Why a dispatch payload cannot carry tokens of `hidden_size`, with the rule, else None: fp8 scales blocks of
    128 elements, nvfp4 blocks of 16."""
    block = {"fp8": FP8_BLOCK, "nvfp4": NVFP4_BLOCK}.get(kind)
    if block is None or hidden_size % block == 0:
        return None
    return (f"hidden_size={hidden_size} is not a multiple of {block}: {kind} dispatch scales the hidden size in "
            f"blocks of {block}")


def quantize_tokens(x: torch.Tensor, payload: str, global_scale: torch.Tensor | float | None = None
                    ) -> TokenPayload:
    """The quantize stage: x [T, H] bf16 → TokenPayload of kind `payload`.

    fp8: per-128-element block scales (amax/448), e4m3. nvfp4: quantized with `global_scale` (fp32
    scalar, required: the layer's static activation scale 1/input_scale) through the registered
    Triton kernel when one is usable on x's device, else the torch reference."""
    if payload not in PAYLOADS:
        raise ValueError(f"unknown dispatch payload {payload!r}; choose one of {', '.join(PAYLOADS)}")
    if payload == "bf16":
        return TokenPayload("bf16", x, source=x)
    if payload == "fp8":
        if payload_size_problem("fp8", x.shape[-1]):
            raise ValueError(f"fp8 dispatch needs the hidden size to be a multiple of {FP8_BLOCK}, got {x.shape[-1]}; "
                             "use the bf16 payload for this model")
        q, s = quantize_fp8_blockwise(x)
        return TokenPayload("fp8", q, s, source=x)
    if global_scale is None:
        raise ValueError("nvfp4 dispatch needs the layer's static activation global scale (448·6/amax = "
                         "1/input_scale): pass global_scale (MoELayer takes it from the weights' w13 input scale)")
    if payload_size_problem("nvfp4", x.shape[-1]):
        raise ValueError(f"nvfp4 dispatch needs the hidden size to be a multiple of {NVFP4_BLOCK}, got {x.shape[-1]}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    packed, sf = nvfp4_quantizer(x.device)(x, gs)
    return TokenPayload("nvfp4", packed, sf, gs, source=x)


def nvfp4_quantizer(device: torch.device):
    """The NVFP4 quantize function for `device`: `kernels.nvfp4.quantize` (the registered Triton
    kernel where usable, on GPU) or, on the CPU, the torch reference `quantize_nvfp4` directly.
    Signature: (x [..., K], global_scale fp32 scalar tensor) → (packed uint8 [..., K/2], e4m3 [..., K/16])."""
    from pdlab.kernels import nvfp4

    if torch.device(device).type == "cuda" and hasattr(nvfp4, "quantize"):
        return lambda x, gs: nvfp4.quantize(x, gs.reshape(1))
    return nvfp4.quantize_nvfp4


# ---------------------------------------------------------------------------------------------
# receive-side expansion and reduction (shared by every backend)


@dataclass
class Expansion:
    """How received token rows were expanded into (row, local expert) pairs.

    mode: "normal" | "low_latency". num_rows: M, the received (de-duplicated) rows.
    normal: row_of [M, k] int64 = grouped row of (row, slot), -1 where the expert is not local.
    low_latency: slot_of [M, k] int64 = flat index e·M_max + m into the masked slab, -1 if not local.
    weights: [M, k] fp32, zero where the expert is not local.
    """

    mode: str
    num_rows: int
    index: torch.Tensor
    weights: torch.Tensor
    num_local_experts: int
    max_m: int = 0


def expand(recv: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_start: int,
           num_local_experts: int, mode: str, max_m: int = 0, all_local: bool = False) -> tuple[Layout, Expansion]:
    """Turn received token rows into the expert layout.

    Args:
        recv: M received rows (data [M, ..], scales [M, ..]).
        topk_ids: [M, k] int32|int64 global expert ids of each row; topk_weights: [M, k] fp32.
        expert_start / num_local_experts: this rank's experts are [expert_start, expert_start + E_l).
        mode: "normal" → Contiguous (one host sync: the row count, unless all_local); "low_latency" → Masked
            [E_l, max_m, ..] without any host sync (rows past masked_m are left uninitialised), so the
            local low-latency path can be captured in a CUDA graph.
        all_local: every expert is on this rank (one rank): a normal-mode layout then has M·k rows, known on the
            host, and is built without a host sync (rows of ids outside the experts are padding, never read).
    Returns: (layout, Expansion for `reduce_rows`)."""
    M, k = topk_ids.shape
    local = topk_ids.long() - expert_start
    valid = (local >= 0) & (local < num_local_experts)
    weights = torch.where(valid, topk_weights.float(), torch.zeros((), device=topk_weights.device))
    if mode == "normal":
        layout, info = group_tokens(recv.data, local, num_local_experts, scales=recv.scales,
                                    global_scale=recv.global_scale, payload=recv.kind,
                                    num_rows=M * k if all_local else None)
        return layout, Expansion(mode, M, info.row_of, weights, num_local_experts)
    if mode != "low_latency":
        raise ValueError(f"unknown dispatch mode {mode!r}; choose one of {', '.join(MODES)}")
    if max_m <= 0:
        raise ValueError(f"low-latency expansion needs max_m > 0 rows per expert, got {max_m}")
    E = num_local_experts
    key = torch.where(valid, local, torch.full_like(local, E)).flatten()  # E = "not local"
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    # scatter_add, not bincount: bincount on CUDA reads max(key) back to the host (a sync)
    counts_all = torch.zeros(E + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts_all, 0) - counts_all
    pos_sorted = torch.arange(M * k, device=key.device) - starts[sorted_key]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    pos = torch.where(key < E, pos, torch.zeros_like(pos))  # not-local pairs land in a dummy slab row 0
    src_row = torch.arange(M * k, device=key.device) // k

    def scatter(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        slab = torch.empty((E + 1, max_m) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        slab[key, pos] = t[src_row]
        return slab[:E]

    masked_m = counts_all[:E].to(torch.int32)
    # M·k bounds the rows (each received row's k slots): the experts size their grids by it, not by the slab
    layout = Masked(scatter(recv.data), masked_m, recv.kind, scatter(recv.scales), recv.global_scale,
                    max_rows=M * k)
    slot = torch.where(key < E, key * max_m + pos, torch.full_like(pos, -1)).view(M, k)
    return layout, Expansion(mode, M, slot, weights, E, max_m)


def reduce_rows(y: Layout, exp: Expansion, chunk_rows: int = 4096, out_dtype: torch.dtype = torch.float32,
                impl: str = "auto") -> torch.Tensor:
    """Σ over local experts of weight · expert output, per received row: [M, H] of out_dtype
    (fp32 accumulation).

    y: the experts' output in the layout `expand` produced (bf16 hidden [N, H] or [E_l, M_max, H]).
    impl: "triton" | "torch" | "auto" (see `_reduce.gather_reduce`)."""
    from pdlab.moe.dispatch._reduce import gather_reduce

    h = y.hidden
    return gather_reduce(h.reshape(-1, h.shape[-1]), exp.index, exp.weights, out_dtype, impl=impl,
                         chunk_rows=chunk_rows)


# ---------------------------------------------------------------------------------------------
# the interface


@dataclass
class DispatchHandle:
    """What combine needs to undo one dispatch (backend-specific `state` inside)."""

    mode: str
    layout_kind: str
    num_tokens: int
    hidden_size: int
    out_dtype: torch.dtype
    expected_shape: tuple[int, ...]
    state: Any = None
    bytes_sent: int = 0  # dispatch bytes this rank put on the wire to other ranks (0 for local)
    bytes_back: int = 0  # combine bytes this rank will send back to other ranks
    config: Mapping[str, Any] = field(default_factory=dict)  # the backend knobs this dispatch ran (combine too)
    config_source: str = "default"  # "explicit" | "default" | "tuned:<file>" (see `BaseDispatcher.call_config`)


class BaseDispatcher(ABC):
    """Moves tokens to their experts' ranks (dispatch) and the weighted outputs back (combine).

    Built once per layer: num_experts E (global), hidden_size H, mode ("normal" |
    "low_latency"), the process group (None = one rank), num_max_dispatch_tokens_per_rank (the
    low-latency buffer's rows per rank), config (backend knobs from the registry's config_space).

    Without a config, each call runs the tuned config of its shape from the store (`tune dispatch`), else the
    registry default: see `call_config` for the bucket every rank agrees on, and `reads_store`."""

    name = "base"
    accepts_deferred = False  # True for backends that quantize inside their dispatch kernels
    # knobs fixed when the dispatcher is built, never taken from the store: they change what a call does, not only
    # its speed (the nccl low-latency exchange decides whether decode syncs the host, so whether it can be captured)
    construction_knobs: tuple[str, ...] = ()

    def __init__(self, num_experts: int, hidden_size: int, *, mode: str = "normal", group: Any = None,
                 rank: int | None = None, world_size: int | None = None,
                 num_max_dispatch_tokens_per_rank: int = 128, config: Mapping[str, Any] | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown dispatch mode {mode!r}; choose one of {', '.join(MODES)}")
        self.num_experts, self.hidden_size, self.mode, self.group = num_experts, hidden_size, mode, group
        self.rank, self.world_size = self._rank_and_size(group, rank, world_size)
        if num_experts % self.world_size:
            raise ValueError(f"{self.name} dispatch: num_experts={num_experts} is not divisible by the "
                             f"{self.world_size} ranks; use an EP size that divides the expert count")
        self.num_local_experts = num_experts // self.world_size
        self.expert_start = self.rank * self.num_local_experts
        self.num_max_dispatch_tokens_per_rank = int(num_max_dispatch_tokens_per_rank)
        from pdlab.kernels import registry
        from pdlab.kernels.tuned import tuned_summary

        self.config = registry.get_backend("moe_dispatch", self.name).config(config)
        self.config_source = "default" if config is None else "explicit"
        self.reads_store = config is None and self._ranks_see_one_store()
        # whether the store has any entry of this backend here (equal on every rank when reads_store): without one
        # every call runs the default, so no rank-agreed count has to be worked out for the lookup
        self.has_tuned_entries = self.reads_store and tuned_summary("moe_dispatch", self.name) is not None

    @staticmethod
    def _rank_and_size(group, rank, world_size) -> tuple[int, int]:
        import torch.distributed as dist

        if rank is None or world_size is None:
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank(group) if rank is None else rank
                world_size = dist.get_world_size(group) if world_size is None else world_size
            else:
                rank, world_size = rank or 0, world_size or 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        return int(rank), int(world_size)

    def _ranks_see_one_store(self) -> bool:
        """Whether every rank resolves tuned configs from the same store (one small all-reduce over the group when
        there are several ranks). The knobs that shape the exchange (chunk counts, DeepEP's channels) must be
        equal on all ranks or the collectives mismatch; ranks that see different files (another PDLAB_CONFIG_DIR,
        another device) all run the registry default instead, with a warning."""
        import torch.distributed as dist

        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return True
        from pdlab.kernels.tuned import store_fingerprint

        fp = store_fingerprint("moe_dispatch", self._group_device())
        hi, neg_lo = self._all_max([fp, -fp])
        if hi == -neg_lo:
            return True
        import logging

        logging.getLogger(__name__).warning(
            "%s dispatch: the ranks see different tuned moe_dispatch configs (another PDLAB_CONFIG_DIR or device on "
            "some rank); every rank runs the registry default %s. Give all ranks the same config folder to use "
            "the tuned ones.", self.name, self.config)
        return False

    def _group_device(self) -> torch.device:
        """Where this group's collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
        import torch.distributed as dist

        if "nccl" in str(dist.get_backend(self.group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_max(self, values: list[int]) -> list[int]:
        """Element-wise max of `values` (ints) over the ranks of the group (one all-reduce, one host sync)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):  # no process group: nothing to agree with
            return [int(v) for v in values]
        t = torch.tensor(values, dtype=torch.int64, device=self._group_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def call_config(self, mode: str, payload: str, top_k: int, tokens_per_rank: int, device=None
                    ) -> tuple[dict, str]:
        """The backend knobs one dispatch (and its combine) runs with, and where they came from.

        A config given at construction always wins ("explicit"). Otherwise, where `reads_store`, the tuned entry
        nearest the bucket {tokens_per_rank, ranks, mode, payload, hidden, experts, top_k} (the keys `tune
        dispatch` stores), else the registry default. `tokens_per_rank` must be a count every rank agrees on:
        the backends pass the buffer's rows per rank in low-latency mode and the largest token count over the
        ranks in normal mode. `construction_knobs` keep their construction-time values."""
        if not self.reads_store:
            return dict(self.config), self.config_source
        from pdlab.kernels.tuned import resolve_config

        bucket = {"tokens_per_rank": int(tokens_per_rank), "ranks": self.world_size, "mode": mode, "payload": payload,
                  "hidden": self.hidden_size, "experts": self.num_experts, "top_k": int(top_k)}
        cfg, source = resolve_config("moe_dispatch", self.name, bucket, device)
        cfg.update({k: self.config[k] for k in self.construction_knobs if k in self.config})
        return cfg, source

    def max_m(self) -> int:
        """Rows per expert of the low-latency slab: num_max_dispatch_tokens_per_rank · world_size."""
        return self.num_max_dispatch_tokens_per_rank * self.world_size

    def supports(self, payload: str, mode: str) -> str | None:
        """None if this dispatcher can move `payload` in `mode`, else the reason and the fix."""
        from pdlab.kernels import registry

        opts = registry.get_backend("moe_dispatch", self.name).options
        if mode not in opts.get("modes", MODES):
            return f"{self.name} dispatch has no {mode} mode (it has {', '.join(opts.get('modes', MODES))})"
        if payload not in opts.get("payloads", PAYLOADS):
            return f"{self.name} dispatch cannot move {payload} payloads (it moves {', '.join(opts['payloads'])})"
        return None

    # --- public API -------------------------------------------------------------------------

    def quantize(self, x: torch.Tensor, payload: str, global_scale: torch.Tensor | float | None = None
                 ) -> TokenPayload:
        """The quantize stage (sender side), x [T, H] bf16 → the payload (global_scale: fp32 scalar, nvfp4 only); see
        `quantize_tokens`."""
        return quantize_tokens(x, payload, global_scale)

    def dispatch(self, x: torch.Tensor | TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 payload: str = "bf16", *, global_scale: torch.Tensor | float | None = None,
                 mode: str | None = None) -> tuple[Layout, DispatchHandle]:
        """Send each token to the ranks of its experts; return this rank's expert layout.

        Args:
            x: [T, H] bf16 tokens, or a TokenPayload from `quantize` (then `payload` is its kind).
            topk_ids: [T, k] int32 (int64 accepted) global expert ids in [0, num_experts): checked on a host
                tensor, and on a device one under PDLAB_CHECK_INVARIANTS=1 (one sync). topk_weights: [T, k] fp32.
            payload: "bf16" | "fp8" | "nvfp4" (nvfp4 needs global_scale, fp32 scalar).
            mode: overrides the dispatcher's mode for this call.
        Returns:
            (Contiguous for "normal" | Masked [E_local, M_max, ..] for "low_latency", handle).
        Raises ShapeError for tensors that break the contract and for expert ids outside the experts (see topk_ids).
        """
        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"unknown dispatch mode {mode!r}; choose one of {', '.join(MODES)}")
        tokens = x if isinstance(x, TokenPayload) else None
        if tokens is None:
            DISPATCH.check(self.name, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
            H = x.shape[1]
        else:
            if tokens.deferred and not self.accepts_deferred:
                raise ValueError(f"{self.name} dispatch got a payload left for another backend to quantize "
                                 "(deferred): make it with this dispatcher's quantize()")
            T = tokens.num_tokens
            DISPATCH.check(self.name, bound={"T": T}, topk_ids=topk_ids, topk_weights=topk_weights)
            H = tokens.hidden_size
        if H != self.hidden_size:
            raise ShapeError("moe_dispatch", self.name, "x", "has the wrong hidden size",
                             f"[T, {self.hidden_size}]", describe_tensor(x if tokens is None else tokens.data),
                             "the dispatcher was built for another hidden size")
        self._check_expert_ids(topk_ids)
        T = topk_ids.shape[0]
        if mode == "low_latency" and T > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"{self.name} low-latency dispatch got {T} tokens on this rank but its buffer holds "
                             f"num_max_dispatch_tokens_per_rank={self.num_max_dispatch_tokens_per_rank}: use "
                             "normal mode for this batch (prefill), split it, or build the dispatcher with a "
                             "larger num_max_dispatch_tokens_per_rank")
        if tokens is None:
            tokens = self.quantize(x, payload, global_scale)
        return self._dispatch(tokens, topk_ids, topk_weights, mode)

    def _check_expert_ids(self, topk_ids: torch.Tensor) -> None:
        """ShapeError for an expert id outside [0, num_experts): read for free from a host tensor, and with one sync
        from a device one under PDLAB_CHECK_INVARIANTS=1 (outside a graph capture). Unchecked, the local dispatcher
        drops such a pair and the nccl one sends it to a rank that does not exist."""
        if not topk_ids.numel() or not (topk_ids.device.type == "cpu" or (ENV.check_invariants and not capturing())):
            return
        bad = ((topk_ids < 0) | (topk_ids >= self.num_experts)).nonzero()
        if bad.numel():
            t, j = bad[0].tolist()
            raise ShapeError("moe_dispatch", self.name, "topk_ids",
                             f"has expert id {int(topk_ids[t, j])} at [{t}, {j}]",
                             f"0 <= id < {self.num_experts} (global expert ids)", describe_tensor(topk_ids),
                             "topk_ids are the router's global expert ids; this dispatcher was built for "
                             f"num_experts={self.num_experts}")

    def combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor:
        """Weighted sum of the experts' outputs back on the tokens' own rank.

        Args: y: the experts' output in the layout dispatch returned (bf16 hidden [N, H] or
            [E_local, M_max, H]). handle: from the matching dispatch.
        Returns: [T, H] bf16 (fp32 accumulation), T = tokens given to dispatch on this rank."""
        kind = getattr(y, "kind", None)
        if kind != handle.layout_kind:
            raise ShapeError("moe_combine", self.name, "y", f"is a {kind or type(y).__name__} layout",
                             f"a {handle.layout_kind} layout (what {handle.mode} dispatch returned)",
                             describe_tensor(getattr(y, "hidden", y)),
                             "combine takes the experts' output in the layout dispatch produced")
        if tuple(y.hidden.shape) != handle.expected_shape or y.hidden.dtype not in (
                torch.bfloat16, torch.float16, torch.float32):
            raise ShapeError("moe_combine", self.name, "y.hidden", "does not match the dispatch",
                             f"[{', '.join(map(str, handle.expected_shape))}] bf16", describe_tensor(y.hidden),
                             "run the experts on the layout from this handle's dispatch (outputs bf16)")
        return self._combine(y, handle)

    # --- backend hooks ----------------------------------------------------------------------

    @abstractmethod
    def _dispatch(self, tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  mode: str) -> tuple[Layout, DispatchHandle]: ...

    @abstractmethod
    def _combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor: ...

    def _handle(self, mode: str, layout: Layout, T: int, out_dtype: torch.dtype, state: Any,
                bytes_sent: int = 0, bytes_back: int = 0, config: tuple[dict, str] | None = None) -> DispatchHandle:
        shape = tuple(layout.hidden.shape[:-1]) + (self.hidden_size,)
        cfg, source = config if config is not None else (self.config, self.config_source)
        return DispatchHandle(mode, LAYOUT_OF_MODE[mode], T, self.hidden_size, out_dtype, shape, state, bytes_sent,
                              bytes_back, cfg, source)

    def describe(self) -> str:
        config = f"tuned per call, default {self.config}" if self.reads_store else f"config={self.config}"
        return (f"{self.name}(mode={self.mode}, rank {self.rank}/{self.world_size}, "
                f"{self.num_local_experts} local experts, {config})")
