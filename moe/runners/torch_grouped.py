"""Runner "torch_grouped": bf16 experts through torch._grouped_mm (the bf16 baseline).

Contiguous: 2-D A [N, K] with offs = offsets[1:] (group ends); masked: 3-D A [E, M, K] batched.
Weights: the bf16 tensors (or the NVFP4 ones dequantised once at first use, cached)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdlab.kernels import registry
from pdlab.moe.layouts import Contiguous


def _probe() -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        if major < 8:
            return "torch._grouped_mm needs sm80 or newer"
    return None


@registry.register_backend("moe_experts", "torch_grouped", archs=("cpu", "cuda"), probe=_probe, priority=5,
                           options={"layouts": ("contiguous", "masked"), "payloads": ("bf16",),
                                    "weights": ("bf16", "nvfp4")})
def run_torch_grouped(layout, weights, *, config):
    """Two torch._grouped_mm calls (gate_up, down) with SiLU·mul between, in bf16; the output in the activations'
    dtype (bf16, or fp16 / fp32 where they were), as every runner returns it."""
    w13, w2 = weights.bf16()
    w13t, w2t = w13.transpose(-2, -1), w2.transpose(-2, -1)  # [E, K, 2I], [E, I, K] views
    x = layout.hidden.to(torch.bfloat16)
    if isinstance(layout, Contiguous):
        offs = layout.offsets[1:]
        gu = torch._grouped_mm(x, w13t, offs=offs, out_dtype=torch.bfloat16)
        g, u = gu.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(g) * u, w2t, offs=offs, out_dtype=torch.bfloat16)
    else:
        gu = torch._grouped_mm(x, w13t, out_dtype=torch.bfloat16)
        g, u = gu.chunk(2, dim=-1)
        out = torch._grouped_mm((F.silu(g) * u).contiguous(), w2t, out_dtype=torch.bfloat16)
    return out.to(layout.hidden.dtype)  # no copy for bf16 activations
