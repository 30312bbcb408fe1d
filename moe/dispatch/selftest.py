"""EP self-checks run on every rank (by the tests on gloo, by `bench moe --ep N` and the GPU scripts
on NCCL): each rank builds the same global inputs from a seed, takes its share, runs the
distributed path and returns what the parent compares with the single-process answer.

These are module-level functions so that spawned ranks can import them (see `spawn.run_ranks`)."""

from __future__ import annotations

import time
from typing import Any

import torch


def rank_device(rank: int) -> torch.device:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_tokens(seed: int, world: int, tokens_per_rank: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype = torch.float32, skew: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ranks' tokens, generated on the CPU from `seed`: x [R·T, H], distinct topk_ids [R·T, k]
    int32, topk_weights [R·T, k] fp32. skew: every token picks expert 0 (all traffic to rank 0)."""
    g = torch.Generator().manual_seed(seed)
    n = world * tokens_per_rank
    x = torch.randn(n, hidden, generator=g).to(dtype)
    ids = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    if skew:
        first = (ids == 0).nonzero()
        ids[first[:, 0], first[:, 1]] = ids[first[:, 0], 0]
        ids[:, 0] = 0
    w = torch.rand(n, top_k, generator=g)
    return x, ids, w


def dispatch_roundtrip(rank: int, world: int, *, seed: int, mode: str, payload: str, tokens_per_rank: int,
                       hidden: int, num_experts: int, top_k: int, dispatcher: str = "nccl",
                       slow_rank: int | None = None, skew: bool = False, config: dict | None = None,
                       max_tokens: int | None = None) -> dict[str, Any]:
    """combine(dispatch(x)) with identity experts (the dequantised payload) on this rank's tokens.

    Returns this rank's output [T, H] (CPU), its dispatched layout's row/expert counts, the bytes
    it sent and the de-duplicated (token, remote rank) pair count it should have sent."""
    from pdlab.moe.dispatch import create_dispatcher
    from pdlab.moe.layouts import dequantize_hidden, with_hidden

    dev = rank_device(rank)
    x, ids, w = global_tokens(seed, world, tokens_per_rank, hidden, num_experts, top_k, dtype=torch.bfloat16,
                              skew=skew)
    sl = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    x, ids, w = x[sl].to(dev), ids[sl].to(dev), w[sl].to(dev)
    d = create_dispatcher(dispatcher, num_experts, hidden, mode=mode, config=config,
                          num_max_dispatch_tokens_per_rank=max_tokens or tokens_per_rank)
    if slow_rank == rank:
        time.sleep(1.5)
    gs = torch.tensor(448 * 6 / 5.0)  # |x| of randn stays well below 5
    layout, handle = d.dispatch(x, ids, w, payload, global_scale=gs)
    y = with_hidden(layout, dequantize_hidden(layout, torch.float32))
    out = d.combine(y, handle)
    E_l = d.num_local_experts
    dest = ids.long() // E_l
    pairs = torch.zeros(ids.shape[0], world, dtype=torch.bool, device=dev).scatter_(1, dest, True)
    pairs[:, rank] = False
    rows = (layout.counts if hasattr(layout, "counts") else layout.masked_m).cpu()
    return {"out": out.cpu(), "per_expert_rows": rows, "bytes_sent": handle.bytes_sent,
            "remote_pairs": int(pairs.sum()), "rank": rank, "layout": layout.kind}


def dispatch_cases(rank: int, world: int, *, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`dispatch_roundtrip` for several cases in one process group (saves start-up time)."""
    return [dispatch_roundtrip(rank, world, **case) for case in cases]


def fail_on_rank(rank: int, world: int, *, bad_rank: int) -> int:
    """Raises on `bad_rank` (after the others entered a collective): tests that a rank's failure
    surfaces with its own traceback instead of a hang or an EOFError."""
    import torch.distributed as dist

    if rank == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return rank
