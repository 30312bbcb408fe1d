"""`deepep` dispatch: an adapter for DeepEP's `deep_ep.Buffer` (legacy v1 API).

Normal mode (prefill): `get_dispatch_layout` → `dispatch` → our Contiguous layout (DeepEP returns
de-duplicated rows [N_recv, H] with local expert ids, -1 for other ranks' experts; we expand them per
expert) → `combine` of the per-row weighted sums. Payloads: bf16 as is, fp8 as DeepEP's
(e4m3 [T, H], fp32 scales [T, H/128]) tuple, nvfp4 as opaque bytes (packed values + e4m3 scales
in one row, viewed as bf16 [T, (H/2 + H/16)/2]) since DeepEP's normal mode only moves bf16/fp8.
Low-latency mode (decode): `low_latency_dispatch` (bf16 in; DeepEP quantizes to fp8 itself with
use_fp8, or to nvfp4 with use_nvfp4 + x_global_scale where the installed DeepEP has it, detected
from its signature) → Masked [E_local, N_max·R, ..] with recv_count as masked_m →
`low_latency_combine` (DeepEP applies the top-k weights).

deep_ep is imported only when a DeepEP dispatcher is built; its absence is reported by the registry.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from pdlab.kernels import nvfp4 as _nvfp4
from pdlab.kernels.registry import register_backend
from pdlab.moe.dispatch.base import BaseDispatcher, DispatchHandle, TokenPayload, expand, reduce_rows
from pdlab.moe.layouts import Layout, Masked


@dataclass
class _NormalState:
    expansion: Any
    deep_handle: Any
    recv_topk_weights: torch.Tensor


@dataclass
class _LowLatencyState:
    deep_handle: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def _has_param(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class DeepEPDispatcher(BaseDispatcher):
    """DeepEP's NVLink/RDMA kernels behind the pdlab dispatcher interface.

    buffer: an existing deep_ep.Buffer to reuse (else one is built, sized from DeepEP's own hints).
    One buffer serves one mode: build one dispatcher per mode (prefill: normal, decode: low_latency)."""

    name = "deepep"
    accepts_deferred = True

    def __init__(self, num_experts: int, hidden_size: int, *, buffer: Any = None,
                 num_nvl_bytes: int | None = None, num_rdma_bytes: int | None = None, **kwargs):
        super().__init__(num_experts, hidden_size, **kwargs)
        import deep_ep

        self._ep = deep_ep
        self.low_latency = self.mode == "low_latency"
        if self.config.get("num_sms") and hasattr(deep_ep.Buffer, "set_num_sms"):
            deep_ep.Buffer.set_num_sms(int(self.config["num_sms"]))
        if buffer is None:
            nvl, rdma = self._buffer_sizes()
            buffer = deep_ep.Buffer(self.group, num_nvl_bytes if num_nvl_bytes is not None else nvl,
                                    num_rdma_bytes if num_rdma_bytes is not None else rdma,
                                    low_latency_mode=self.low_latency,
                                    num_qps_per_rank=max(1, self.num_local_experts) if self.low_latency else 1)
        self.buffer = buffer
        self.has_nvfp4 = _has_param(buffer.low_latency_dispatch, "use_nvfp4")

    def _buffer_sizes(self) -> tuple[int, int]:
        Buffer, R, H = self._ep.Buffer, self.world_size, self.hidden_size
        if self.low_latency:
            hint = getattr(Buffer, "get_low_latency_rdma_size_hint", None)
            rdma = hint(self.num_max_dispatch_tokens_per_rank, H, R, self.num_experts) if hint else 1 << 30
            return 0, int(rdma)
        nvl = 1 << 30
        if hasattr(Buffer, "get_dispatch_config") and hasattr(Buffer, "get_combine_config"):
            nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, R)
                      for cfg in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)))
        return int(nvl), 0

    def supports(self, payload: str, mode: str) -> str | None:
        if mode != self.mode:
            return (f"this DeepEP buffer was built for {self.mode} mode; build a second deepep dispatcher "
                    f"with mode={mode!r}")
        if mode == "low_latency" and payload == "nvfp4" and not self.has_nvfp4:
            return ("the installed deep_ep has no nvfp4 low-latency dispatch (no use_nvfp4 argument): use "
                    "payload fp8 or bf16 with deepep, or the nccl dispatcher for nvfp4")
        return None

    def quantize(self, x: torch.Tensor, payload: str, global_scale: torch.Tensor | float | None = None
                 ) -> TokenPayload:
        """x [T, H] bf16 → its payload. Low-latency fp8 / nvfp4: DeepEP quantizes inside its dispatch kernel, so this
        stage only records the payload kind (deferred; global_scale an fp32 scalar); normal mode quantizes here as
        every backend does."""
        if self.mode == "low_latency" and payload in ("fp8", "nvfp4"):
            if payload == "nvfp4" and global_scale is None:
                return super().quantize(x, payload, global_scale)  # the same error as everywhere
            gs = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32,
                                                                    device=x.device).reshape(())
            return TokenPayload(payload, x, None, gs, source=x, deferred=True)
        return super().quantize(x, payload, global_scale)

    def _deep_config(self, config: dict) -> Any:
        """deep_ep.Config of the normal-mode kernels from `config`'s knobs; None (DeepEP's own) when not all set."""
        keys = ("nvl_chunk_size", "nvl_buffer_size", "rdma_chunk_size", "rdma_buffer_size")
        if not all(k in config for k in keys) or not hasattr(self._ep, "Config"):
            return None
        return self._ep.Config(int(config.get("num_sms", 24)), *(int(config[k]) for k in keys))

    # --- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  mode: str) -> tuple[Layout, DispatchHandle]:
        reason = self.supports(tokens.kind, mode)
        if reason:
            raise ValueError(f"deepep dispatch: {reason}")
        topk_idx = topk_ids.to(torch.int64)
        out_dtype = tokens.source.dtype if tokens.source is not None else torch.bfloat16
        if mode == "low_latency":
            return self._dispatch_ll(tokens, topk_idx, topk_weights.float(), out_dtype)
        return self._dispatch_normal(tokens, topk_idx, topk_weights.float(), out_dtype)

    def _dispatch_normal(self, tokens, topk_idx, topk_weights, out_dtype):
        T, H = topk_idx.shape[0], self.hidden_size
        n_rank, n_rdma, n_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        if tokens.kind == "bf16":
            x = tokens.data
        elif tokens.kind == "fp8":
            x = (tokens.data, tokens.scales)
        else:  # nvfp4 rows as opaque bytes (DeepEP's normal mode moves bf16 / fp8 only)
            x = torch.cat([tokens.data, tokens.scales.view(torch.uint8)], dim=1).view(torch.bfloat16)
        kwargs = dict(num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
                      num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        # DeepEP's channels must match on every rank: the tuned config is keyed by the largest token count over
        # the ranks (one all-reduce, only when the store holds entries of this backend)
        agreed = self._all_max([T])[0] if self.has_tuned_entries and self.world_size > 1 else T
        config = self.call_config("normal", tokens.kind, topk_idx.shape[1], agreed, topk_idx.device)
        cfg = self._deep_config(config[0])
        if cfg is not None:
            kwargs["config"] = cfg
        recv_x, recv_idx, recv_w, _per_expert, handle, _ = self.buffer.dispatch(x, **kwargs)
        if tokens.kind == "bf16":
            recv = TokenPayload("bf16", recv_x)
        elif tokens.kind == "fp8":
            recv = TokenPayload("fp8", recv_x[0], recv_x[1])
        else:
            raw = recv_x.view(torch.uint8)
            recv = TokenPayload("nvfp4", raw[:, :H // 2], raw[:, H // 2:].view(torch.float8_e4m3fn),
                                tokens.global_scale)
        # DeepEP hands back local expert ids (-1: another rank's expert)
        layout, exp = expand(recv, recv_idx, recv_w, 0, self.num_local_experts, "normal")
        sent = int(in_rank.sum()) * tokens.row_bytes() if T else 0
        back = exp.num_rows * H * 2
        return layout, self._handle("normal", layout, T, out_dtype, _NormalState(exp, handle, recv_w), sent, back,
                                    config)

    def _dispatch_ll(self, tokens, topk_idx, topk_weights, out_dtype):
        T, H = topk_idx.shape[0], self.hidden_size
        source = tokens.source
        if source is None:
            raise ValueError("deepep low-latency dispatch quantizes inside DeepEP and needs the bf16 tokens: "
                             "pass x (bf16) or a TokenPayload made by quantize() (it keeps .source)")
        kwargs: dict[str, Any] = dict(use_fp8=tokens.kind == "fp8", async_finish=False, return_recv_hook=False)
        if tokens.kind == "nvfp4":
            kwargs.update(use_fp8=False, use_nvfp4=True, x_global_scale=tokens.global_scale.reshape(1))
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            source.to(torch.bfloat16), topk_idx, self.num_max_dispatch_tokens_per_rank, self.num_experts, **kwargs)
        masked_m = recv_count.to(torch.int32)
        M = self.max_m()
        # every rank sends at most num_max_dispatch_tokens_per_rank tokens of top-k (token, expert) pairs each: the
        # rows this rank can receive, which the experts size their grids by instead of the whole slab
        bound = M * topk_idx.shape[1]
        if tokens.kind == "bf16":
            layout = Masked(recv_x, masked_m, max_rows=bound)
        elif tokens.kind == "fp8":
            # DeepEP hands the scales over M-major (a transposed [E, K/128, M] buffer, for TMA): the layout's
            # kernels read them K-major
            layout = Masked(recv_x[0], masked_m, "fp8", recv_x[1].float().contiguous(), max_rows=bound)
        else:
            packed, scales = _nvfp4_from_deepep(recv_x[0], recv_x[1], M, H)
            layout = Masked(packed, masked_m, "nvfp4", scales, tokens.global_scale, max_rows=bound)
        # every (token, expert) pair travels on its own in DeepEP's low-latency kernels
        sent = T * topk_idx.shape[1] * tokens.row_bytes()
        back = T * topk_idx.shape[1] * H * 2  # no host sync here: each (token, expert) row comes back once
        config = self.call_config("low_latency", tokens.kind, topk_idx.shape[1], self.num_max_dispatch_tokens_per_rank,
                                  topk_idx.device)
        return layout, self._handle("low_latency", layout, T, out_dtype,
                                    _LowLatencyState(handle, topk_idx, topk_weights), sent, back, config)

    # --- combine ------------------------------------------------------------------------------

    def _combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor:
        st = handle.state
        if handle.mode == "low_latency":
            out, _, _ = self.buffer.low_latency_combine(y.hidden.to(torch.bfloat16), st.topk_idx, st.topk_weights,
                                                        st.deep_handle)
            return out.to(handle.out_dtype)
        partial = reduce_rows(y, st.expansion, int(handle.config.get("chunk_rows", 4096)), torch.bfloat16,
                              handle.config.get("reduce_impl", "auto"))
        kwargs = {}
        cfg = self._deep_config(dict(handle.config))
        if cfg is not None:
            kwargs["config"] = cfg
        out, _, _ = self.buffer.combine(partial, st.deep_handle, topk_weights=st.recv_topk_weights, **kwargs)
        return out.to(handle.out_dtype)


def _nvfp4_from_deepep(packed: torch.Tensor, scales: torch.Tensor, max_m: int, hidden: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's nvfp4 low-latency output → our masked nvfp4 tensors.

    packed: [E, H/2, M] uint8 (DeepEP's K-major order) or [E, M, H/2] → [E, M, H/2] contiguous.
    scales: 128x4-swizzled per expert ([E, ...], any 1-byte dtype) or row-major [E, M, H/16] →
    row-major [E, M, H/16] float8_e4m3fn."""
    E = packed.shape[0]
    if packed.shape[1:] == (hidden // 2, max_m) and packed.shape[1:] != (max_m, hidden // 2):
        packed = packed.transpose(1, 2)
    packed = packed.contiguous()
    k16 = hidden // 16
    s = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    if tuple(s.shape) != (E, max_m, k16):
        s = _nvfp4.unswizzle_scales_128x4(s.reshape(E, -1), max_m, k16)
    return packed, s.contiguous().view(torch.float8_e4m3fn)


def _probe() -> str | None:
    import importlib

    ep = importlib.import_module("deep_ep")
    missing = [m for m in ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
                           "low_latency_combine") if not hasattr(getattr(ep, "Buffer", None), m)]
    if missing:
        return f"deep_ep.Buffer lacks {', '.join(missing)} (needs the v1 legacy Buffer API)"
    return None


@register_backend("moe_dispatch", "deepep", archs=("sm90", "sm100"), packages=("deep_ep",), probe=_probe,
                  priority=30,
                  config_space={"num_sms": [20, 24, 32], "nvl_chunk_size": [4, 6, 8, 12],
                                "nvl_buffer_size": [256, 512], "rdma_chunk_size": [8, 16],
                                "rdma_buffer_size": [128, 256], "reduce_impl": ["triton", "torch"]},
                  default_config={"num_sms": 24, "reduce_impl": "auto", "chunk_rows": 4096},
                  options={"modes": ("normal", "low_latency"), "payloads": ("bf16", "fp8", "nvfp4"),
                           "layouts": ("contiguous", "masked"), "one_mode_per_buffer": True})
def create_deepep(num_experts: int, hidden_size: int, **kwargs) -> DeepEPDispatcher:
    """DeepEP Buffer: normal (get_dispatch_layout/dispatch/combine) or low-latency kernels."""
    return DeepEPDispatcher(num_experts, hidden_size, **kwargs)
