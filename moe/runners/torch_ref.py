"""Runner "torch": the reference. Dequantises activations and weights, computes in fp32, any layout
and payload, one expert at a time (syncs to read counts, which it checks: `check_rows`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdlab.kernels import registry
from pdlab.moe.layouts import Contiguous, dequantize_hidden


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [M, H] fp32, w13 [2I, H] (gate rows then up rows), w2 [H, I] → [M, H] fp32."""
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.T


_FORMS = ("auto", "bf16", "nvfp4")


@registry.register_backend("moe_experts", "torch", archs=("cpu", "cuda"), priority=0, reference=True,
                           default_config={"weights": "auto"}, config_space={},
                           options={"layouts": ("contiguous", "masked"), "payloads": ("bf16", "fp8", "nvfp4"),
                                    "weights": ("bf16", "nvfp4"), "compute": "fp32"})
def run_torch(layout, weights, *, config):
    """fp32 reference. config["weights"]: "auto" (NVFP4 when present, else bf16) | "bf16" | "nvfp4"."""
    layout.check_rows("moe_experts", "torch")
    form = config.get("weights", "auto")
    if form not in _FORMS:
        raise ValueError(f"moe_experts[torch]: config weights={form!r}; choose one of "
                         f"{', '.join(map(repr, _FORMS))} (auto: NVFP4 when present, else bf16)")
    have = {"bf16": weights.has_bf16, "nvfp4": weights.has_nvfp4}
    if form != "auto" and not have[form]:
        raise ValueError(f"moe_experts[torch]: config weights={form!r}, but these weights have no {form} form "
                         f"(they carry {'nvfp4' if weights.has_nvfp4 else 'bf16'} only): pass weights='auto', or "
                         "build ExpertWeights.from_bf16(..., quantize=True) to hold both")
    if form == "bf16" or (form == "auto" and not weights.has_nvfp4):
        w13, w2 = weights.w13.float(), weights.w2.float()
    else:
        w13, w2 = weights.prepare("torch_fp32", lambda w: w.dequantized(torch.float32))
    x = dequantize_hidden(layout, torch.float32)
    out_dtype = layout.hidden.dtype if layout.payload == "bf16" else torch.bfloat16
    out = torch.zeros(x.shape[:-1] + (weights.hidden_size,), dtype=out_dtype, device=x.device)
    if isinstance(layout, Contiguous):
        offs = layout.offsets.tolist()
        for e in range(layout.num_experts):
            if offs[e + 1] > offs[e]:
                out[offs[e]:offs[e + 1]] = expert_mlp(x[offs[e]:offs[e + 1]], w13[e], w2[e]).to(out_dtype)
    else:
        for e, m in enumerate(layout.masked_m.tolist()):
            if m > 0:
                out[e, :m] = expert_mlp(x[e, :m], w13[e], w2[e]).to(out_dtype)
    return out
