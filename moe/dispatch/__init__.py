"""Token dispatch/combine for expert parallelism: one interface, backends `local`, `nccl`, `deepep`
registered as op "moe_dispatch" (each backend file registers itself)."""

from __future__ import annotations

from typing import Any

from pdlab.moe.dispatch import deepep as _deepep  # noqa: F401  (registers)
from pdlab.moe.dispatch import local as _local  # noqa: F401  (registers)
from pdlab.moe.dispatch import nccl as _nccl  # noqa: F401  (registers)
from pdlab.moe.dispatch.base import (MODES, BaseDispatcher, DispatchHandle, TokenPayload, payload_row_bytes,
                                     quantize_tokens)

__all__ = ["MODES", "BaseDispatcher", "DispatchHandle", "TokenPayload", "create_dispatcher",
           "payload_row_bytes", "quantize_tokens"]


def create_dispatcher(name: str | None, num_experts: int, hidden_size: int, **kwargs: Any) -> BaseDispatcher:
    """Build dispatcher `name` ("local" | "nccl" | "deepep"; None: "local" on one rank, else the most
    preferred usable multi-rank backend). kwargs: mode, group, rank, world_size,
    num_max_dispatch_tokens_per_rank, config, and backend-specific ones."""
    from pdlab.kernels import registry

    if isinstance(name, BaseDispatcher):
        return name
    if name is None:
        world = BaseDispatcher._rank_and_size(kwargs.get("group"), kwargs.get("rank"), kwargs.get("world_size"))[1]
        if world == 1:
            name = "local"
        else:
            name = registry.select("moe_dispatch", accept=lambda b: b.options.get("max_ranks", 1 << 30) > 1).name
    backend = registry.select("moe_dispatch", name)
    return backend.impl(num_experts, hidden_size, **kwargs)
