"""Seeded random expert problems for the runner tests (CPU under the Triton interpreter, or GPU)."""

from __future__ import annotations

import torch

from pdlab.moe.layouts import Layout, group_tokens, quantize_payload
from pdlab.moe.weights import ExpertWeights


def random_experts_problem(E: int, H: int, I: int, T: int, k: int, payload: str, device: str | torch.device,
                           skew: str | None = None, x_dtype: torch.dtype = torch.float32, seed: int = 0
                           ) -> tuple[Layout, ExpertWeights]:
    """A Contiguous layout of T tokens routed to k of E experts, and NVFP4 (+ bf16) expert weights.

    Weights: w13 [E, 2I, H], w2 [E, H, I] ~ N(0, 1/fan_in), quantized to NVFP4. Tokens x [T, H] ~ N(0, 1)
    as `payload` ("bf16": cast to x_dtype; "fp8" / "nvfp4": quantized). skew: None (k distinct random
    experts per token), "one" (every token to expert E-1), "zero" (only experts 1 and 3: 0 and 2 get no
    tokens). Generated on the CPU from `seed`, then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device)
    weights = ExpertWeights.from_bf16(w13, w2, quantize=True)
    x = torch.randn(T, H, generator=g).to(device)
    if skew == "one":
        ids = torch.full((T, 1), E - 1, dtype=torch.int32)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        if skew == "zero":
            ids = (torch.randint(0, 2, (T, 1), generator=g) * 2 + 1).int()
    hidden, scales, gs = quantize_payload(x.to(x_dtype) if payload == "bf16" else x, payload)
    layout, _ = group_tokens(hidden, ids.to(device), E, scales=scales, global_scale=gs)
    return layout, weights
