"""Runner "cutedsl": Blackwell (sm100) NVFP4 experts through flashinfer's CuTe DSL kernels.

Chain (masked layout only): scaled_fp4_grouped_quantize (bf16 payload; an nvfp4 payload arrives
quantized) → grouped_gemm_nt_masked (gate_up) → silu_and_mul_scaled_nvfp4_experts_quantize →
grouped_gemm_nt_masked (down). The kernels take "logical [m, k, l]" views of physical [l, m, k]
tensors (permute(1, 2, 0)) and block scales in the 128x4 swizzled layout.

Repacked once per ExpertWeights (prepared["cutedsl"]): block scales swizzled
(kernels.nvfp4.swizzle_scales_128x4), a13_gs [E] = 1/max(w13_input_scale) (static activation
scale), alpha1 [E] = w13_weight_scale_2 / a13_gs, a2_gs [E] = 1/w2_input_scale, alpha2 [E] =
w2_input_scale · w2_weight_scale_2. Module locations differ between flashinfer releases: each
function is looked up in several places.
"""

from __future__ import annotations

import importlib

import torch

from pdlab.kernels import registry
from pdlab.kernels.nvfp4 import swizzle_scales_128x4

_LOCATIONS = {
    "grouped_gemm_nt_masked": ("flashinfer.cute_dsl.blockscaled_gemm", "flashinfer.cute_dsl", "flashinfer.gemm",
                               "flashinfer"),
    "scaled_fp4_grouped_quantize": ("flashinfer", "flashinfer.fp4_quantization", "flashinfer.quantization"),
    "silu_and_mul_scaled_nvfp4_experts_quantize": ("flashinfer", "flashinfer.activation",
                                                   "flashinfer.fp4_quantization"),
}


def find_function(name: str):
    """The flashinfer function `name` from the first module that has it; RuntimeError listing where
    it was looked for otherwise."""
    for mod in _LOCATIONS[name]:
        try:
            fn = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    raise RuntimeError(f"flashinfer has no {name} in {', '.join(_LOCATIONS[name])}; install a flashinfer "
                       "release with the CuTe DSL NVFP4 MoE kernels (>= 0.4)")


def _probe() -> str | None:
    for name in _LOCATIONS:
        try:
            find_function(name)
        except RuntimeError as exc:
            return str(exc)
    return None


def prepare_weights(w) -> dict:
    """Repack NVFP4 ExpertWeights for the CuTe DSL kernels (once)."""
    if not w.has_nvfp4 or w.w13_input_scale is None or w.w2_input_scale is None:
        raise ValueError("moe_experts[cutedsl] needs NVFP4 weights with input scales (from_modelopt, or "
                         "from_bf16(quantize=True))")
    E = w.num_experts
    a13_gs = w.activation_global_scale.expand(E).contiguous().float()
    p = w.plain_nvfp4()
    return {
        "w13": p["w13_weight"], "w2": p["w2_weight"],
        "w13_sf": swizzle_scales_128x4(p["w13_weight_scale"].view(torch.float8_e4m3fn)),
        "w2_sf": swizzle_scales_128x4(p["w2_weight_scale"].view(torch.float8_e4m3fn)),
        "a13_gs": a13_gs,
        "alpha1": (w.w13_weight_scale_2.float() / a13_gs).contiguous(),
        "a2_gs": (1.0 / w.w2_input_scale.float()).contiguous(),
        "alpha2": (w.w2_input_scale.float() * w.w2_weight_scale_2.float()).contiguous(),
    }


@registry.register_backend("moe_experts", "cutedsl", archs=("sm100",), packages=("flashinfer", "cutlass"),
                           probe=_probe, priority=30,
                           options={"layouts": ("masked",), "payloads": ("bf16", "nvfp4"), "weights": ("nvfp4",),
                                    "compute": "fp4"})
def run_cutedsl(layout, weights, *, config):
    """flashinfer CuTe DSL chain on the masked layout; returns [E, M, H] bf16."""
    gemm = find_function("grouped_gemm_nt_masked")
    p = weights.prepare("cutedsl", prepare_weights)
    E, M = layout.hidden.shape[:2]
    H, I = weights.hidden_size, weights.intermediate_size
    masked_m = layout.masked_m
    if layout.payload == "bf16":
        quantize = find_function("scaled_fp4_grouped_quantize")
        aq, aq_sf = quantize(layout.hidden.to(torch.bfloat16), masked_m, p["a13_gs"])
        alpha1 = p["alpha1"]
    else:  # pre-quantized NVFP4 payload: row-major scales → swizzled, alpha from its global scale
        aq = layout.hidden.view(torch.uint8).permute(1, 2, 0)
        aq_sf = swizzle_scales_128x4(layout.scales.view(torch.float8_e4m3fn))
        gs = layout.global_scale.float().reshape(-1).expand(E)
        alpha1 = (weights.w13_weight_scale_2.float() / gs).contiguous()
    dev = layout.hidden.device
    gate_up = torch.empty((E, M, 2 * I), dtype=torch.bfloat16, device=dev)
    kw = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=16,
              alpha_dtype="float32")
    gemm((aq, aq_sf), (p["w13"].permute(1, 2, 0), p["w13_sf"]), gate_up.permute(1, 2, 0), masked_m,
         alpha=alpha1.view(1, 1, E), **kw)
    act = find_function("silu_and_mul_scaled_nvfp4_experts_quantize")
    hq, hq_sf = act(gate_up, masked_m, p["a2_gs"])
    out = torch.empty((E, M, H), dtype=torch.bfloat16, device=dev)
    gemm((hq, hq_sf), (p["w2"].permute(1, 2, 0), p["w2_sf"]), out.permute(1, 2, 0), masked_m,
         alpha=p["alpha2"].view(1, 1, E), **kw)
    return out
