"""Building blocks of the DeepSeek-V3 model: RMSNorm, the (YaRN) rotary embedding of the pe dims,
projection helpers and the dense SiLU MLP.

Projections are small classes (`ReplicatedLinear`, `ColumnParallelLinear`, `RowParallelLinear`,
`MergedColumnLinear`) so tensor parallelism can be added in their `forward` (a gather / all-reduce)
without touching the model; today they require tp_size 1."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdlab.runtime.model.config import RopeConfig


class RMSNorm(nn.Module):
    """y = weight · (x / sqrt(mean(x²) + eps)), computed in fp32 and cast back before the weight
    multiply (transformers' DeepseekV3RMSNorm order). x: [..., D] any float → same shape/dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] any float dtype → [..., dim] same dtype (normalised in fp32)."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary embedding of the `qk_rope_head_dim` dims, default or YaRN (DeepSeek-V3 semantics).

    forward(positions [T] int64, dtype) → (cos, sin) [T, dim/2] of `dtype`, already multiplied by
    YaRN's attention factor. `rotate(x [T, ..., dim], cos, sin)` rotates: interleaved layout (pairs
    (x0, x1), (x2, x3), ...) returns the rotated pairs de-interleaved as [evens' | odds'] — the layout
    transformers and DeepSeek's reference produce; both q_pe and k_pe use it, so their dot products
    are those of the interleaved rotation. Non-interleaved: rotate-half pairs (x_i, x_{i+dim/2})."""

    def __init__(self, dim: int, rope: RopeConfig):
        super().__init__()
        self.dim = dim
        self.interleave = rope.interleave
        self.attention_factor = rope.attention_factor
        # computed on the CPU (as transformers does) so every device gets the same frequencies, then
        # placed where the module is being built
        device = torch.empty(0).device
        self.register_buffer("inv_freq", _inv_freq(dim, rope).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int → (cos, sin) [T, dim/2] of `dtype` (on positions' device)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim] → rotated, same shape and dtype. cos/sin: [T, dim/2] from forward."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _inv_freq(dim: int, rope: RopeConfig) -> torch.Tensor:
    """[dim/2] fp32 on the CPU: default or YaRN-blended inverse frequencies."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    if rope.kind != "yarn":
        return 1.0 / pos_freqs
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # share of the original (extrapolated) frequency per dim pair
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ (+ b), the full weight on every rank. x: [..., in] → [..., out], weight's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError(f"not implemented: tensor parallelism (tp_size {tp_size}), because "
                                      "this runtime serves tp_size 1 only")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] → [..., out_features], the weight's dtype."""
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split over TP ranks (no communication in forward); tp_size 1 today."""


class RowParallelLinear(ReplicatedLinear):
    """Input features split over TP ranks (all-reduce after the GEMM); tp_size 1 today."""


class MergedColumnLinear(ColumnParallelLinear):
    """Several column projections of the same input in one GEMM (gate|up). `parts` are the output
    sizes in checkpoint order; the loader fills weight rows part by part."""

    def __init__(self, in_features: int, parts: tuple[int, ...], tp_size: int = 1):
        super().__init__(in_features, sum(parts), bias=False, tp_size=tp_size)
        self.parts = parts


class DenseMLP(nn.Module):
    """down(silu(gate(x)) · up(x)), gate|up merged. x: [T, H] → [T, H], weight dtype."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnLinear(hidden_size, (intermediate_size, intermediate_size))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → down(silu(gate(x)) * up(x)) [T, hidden], the weights' dtype."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
