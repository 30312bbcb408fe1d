"""EP self-checks run on every rank (by the tests on gloo, by `bench moe --ep N` and the GPU scripts
on NCCL): each rank builds the same global inputs from a seed, takes its share, runs the
distributed path and returns what the parent compares with the single-process answer.

These are module-level functions so that spawned ranks can import them (see `spawn.run_ranks`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from pdlab.kernels.graphs import capture_graph


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
                       max_tokens: int | None = None, rank_tokens: list[int] | None = None,
                       config_dirs: list[str] | None = None) -> dict[str, Any]:
    """combine(dispatch(x)) with identity experts (the dequantised payload) on this rank's tokens.

    Returns this rank's output [T, H] (CPU), its dispatched layout's row/expert counts, the bytes
    it sent, the de-duplicated (token, remote rank) pair count it should have sent, and the config the
    call ran with (`config`, `config_source`).
    rank_tokens: uneven tokens per rank (e.g. [0, 7]: rank 0 has none); default tokens_per_rank each.
    config_dirs: each rank's PDLAB_CONFIG_DIR (tuned-config folder) for this case."""
    import os

    from pdlab.kernels import tuned
    from pdlab.moe.dispatch import create_dispatcher
    from pdlab.moe.layouts import dequantize_hidden, with_hidden

    if config_dirs is not None:
        os.environ[tuned.CONFIG_DIR_ENV] = config_dirs[rank]
        tuned.clear_cache()
    dev = rank_device(rank)
    counts = rank_tokens or [tokens_per_rank] * world
    x, ids, w = global_tokens(seed, 1, sum(counts), hidden, num_experts, top_k, dtype=torch.bfloat16, skew=skew)
    sl = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    x, ids, w = x[sl].to(dev), ids[sl].to(dev), w[sl].to(dev)
    d = create_dispatcher(dispatcher, num_experts, hidden, mode=mode, config=config,
                          num_max_dispatch_tokens_per_rank=max_tokens or max(counts))
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
            "remote_pairs": int(pairs.sum()), "rank": rank, "layout": layout.kind, "config": dict(handle.config),
            "config_source": handle.config_source}


def low_latency_graph(rank: int, world: int, *, payload: str = "nvfp4", tokens_per_rank: int = 64,
                      hidden: int = 7168, num_experts: int = 256, top_k: int = 8) -> dict[str, Any]:
    """NCCL low-latency dispatch + combine (byte-valued stand-in experts) with the fixed exchange: run once eagerly,
    then again with host syncs turned into errors, then captured in a CUDA graph and replayed.

    Returns the largest |graph - eager| and |no-sync run - eager| over this rank's [T, H] output."""
    from pdlab.moe.dispatch import create_dispatcher
    from pdlab.moe.layouts import with_hidden

    dev = rank_device(rank)
    x, ids, w = global_tokens(rank + 31, 1, tokens_per_rank, hidden, num_experts, top_k, dtype=torch.bfloat16)
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    gs = torch.tensor(448 * 6 / 5.0, device=dev)
    d = create_dispatcher("nccl", num_experts, hidden, mode="low_latency",
                          num_max_dispatch_tokens_per_rank=tokens_per_rank, config={"ll_exchange": "fixed"})

    def experts(layout) -> torch.Tensor:
        """A sync-free stand-in for the experts: the dispatched bytes as numbers, [E_l, M_max, H] bf16
        (the reference dequantisation reads scales back to the host)."""
        h = layout.hidden.view(torch.uint8).to(torch.bfloat16)
        return h.repeat(1, 1, -(-hidden // h.shape[-1]))[..., :hidden] * 1e-2

    def step() -> torch.Tensor:
        layout, handle = d.dispatch(d.quantize(x, payload, gs), ids, w, payload)
        return d.combine(with_hidden(layout, experts(layout)), handle)

    eager = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nosync = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return {"graph_diff": float((captured.float() - eager.float()).abs().max()),
            "nosync_diff": float((nosync.float() - eager.float()).abs().max()),
            "scale": float(eager.float().abs().max())}


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


def random_moe(seed: int, cfg, device: torch.device | str = "cpu", keep_bf16: bool = False,
               input_amax: float = 6.0):
    """Seeded random MoE parameters for `cfg` (a MoEConfig): (ExpertWeights with NVFP4 tensors
    (+ bf16 when keep_bf16), gate_weight [E, H] fp32, correction_bias [E] fp32). Generated per
    expert on `device` from per-expert seeds, so every rank builds the same weights."""
    from pdlab.moe.weights import ExpertWeights

    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    dev = torch.device(device)
    g = torch.Generator(device=dev)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev)
    for e in range(E):
        g.manual_seed(seed * 100003 + e)
        w13[e] = (torch.randn(2 * I, H, generator=g, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2[e] = (torch.randn(H, I, generator=g, device=dev) * I ** -0.5).to(torch.bfloat16)
    weights = ExpertWeights.from_bf16(w13, w2, quantize=True, keep_bf16=keep_bf16, input_amax=input_amax)
    g.manual_seed(seed * 100003 + E + 1)
    gate = torch.randn(E, H, generator=g, device=dev) * H ** -0.5
    bias = torch.randn(E, generator=g, device=dev) * 0.05
    return weights, gate, bias


def ep_layer_forward(rank: int, world: int, *, seed: int, cfg, tokens_per_rank: int, cases: list[dict[str, Any]]
                     ) -> list[torch.Tensor]:
    """MoELayer over `dispatcher` (nccl by default) on this rank's share of seeded tokens; one
    output [T, H] (CPU) per case. case keys: mode, payload, runner, dispatcher, dispatcher_kwargs."""
    from pdlab.moe.layer import MoELayer

    dev = rank_device(rank)
    weights, gate, bias = random_moe(seed, cfg, dev)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(world * tokens_per_rank, cfg.hidden_size, generator=g).to(torch.bfloat16)
    x = x[rank * tokens_per_rank:(rank + 1) * tokens_per_rank].to(dev)
    outs = []
    for case in cases:
        layer = MoELayer(cfg, weights, gate, bias, None, case.get("dispatcher", "nccl"), case.get("runner"),
                         case["mode"], payload=case.get("payload", "bf16"),
                         num_max_dispatch_tokens_per_rank=tokens_per_rank,
                         dispatcher_kwargs=case.get("dispatcher_kwargs"))
        outs.append(layer(x).cpu())
    return outs


def sleep_on_rank(rank: int, world: int, *, seconds: float, pid_dir: str | None = None) -> int:
    """Writes its pid to `pid_dir/rank<r>` and sleeps: tests that stopping the parent stops the ranks."""
    import os

    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(seconds)
    return rank
