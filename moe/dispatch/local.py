"""`local` dispatch: one rank, no communication (the default on one GPU or the CPU).

Dispatch groups the (token, expert) pairs by expert (normal: T·k rows, so no host sync either) or scatters them
into the masked slab (low-latency, no host sync, so it can be captured in a CUDA graph); combine is the fp32
weighted sum over each token's experts."""

from __future__ import annotations

import torch

from pdlab.kernels.registry import register_backend
from pdlab.moe.dispatch.base import BaseDispatcher, DispatchHandle, TokenPayload, expand, reduce_rows
from pdlab.moe.layouts import Layout


class LocalDispatcher(BaseDispatcher):
    """All experts on this rank: dispatch = layout building, combine = weighted reduction."""

    name = "local"

    def __init__(self, num_experts: int, hidden_size: int, **kwargs):
        kwargs.pop("group", None)
        kwargs.update(rank=0, world_size=1)
        super().__init__(num_experts, hidden_size, **kwargs)

    def _dispatch(self, tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  mode: str) -> tuple[Layout, DispatchHandle]:
        # one rank: an expert gets each token at most once, so T rows per expert always suffice (T is
        # static within a captured graph, so this stays graph-safe); at least one: a step of no tokens gets an empty
        # slab (masked_m all 0), not a slab of no rows
        T, k = topk_ids.shape
        rows = max(1, min(self.max_m(), T)) if mode == "low_latency" else self.max_m()
        layout, exp = expand(tokens, topk_ids, topk_weights, 0, self.num_local_experts, mode, rows, all_local=True)
        out_dtype = tokens.source.dtype if tokens.source is not None else torch.bfloat16
        # one rank: the batch's own token count keys the tuned config (no other rank has to agree)
        config = self.call_config(mode, tokens.kind, k, T, tokens.data.device)
        return layout, self._handle(mode, layout, T, out_dtype, exp, config=config)

    def _combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor:
        return reduce_rows(y, handle.state, int(handle.config["chunk_rows"]), handle.out_dtype,
                           handle.config["reduce_impl"])


@register_backend("moe_dispatch", "local", archs=("cpu", "cuda"), priority=10, reference=True,
                  config_space={"reduce_impl": ["triton", "torch"], "chunk_rows": [2048, 4096, 8192]},
                  default_config={"reduce_impl": "auto", "chunk_rows": 4096},
                  options={"modes": ("normal", "low_latency"), "payloads": ("bf16", "fp8", "nvfp4"),
                           "layouts": ("contiguous", "masked"), "max_ranks": 1})
def create_local(num_experts: int, hidden_size: int, **kwargs) -> LocalDispatcher:
    """One rank, no communication: every expert is local."""
    return LocalDispatcher(num_experts, hidden_size, **kwargs)
