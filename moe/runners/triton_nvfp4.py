"""Runner "triton": pdlab's NVFP4 W4A16 grouped GEMMs (moe/triton/nvfp4_moe.py), any CUDA GPU.

gate_up GEMM with SiLU·mul fused in its epilogue → intermediate [rows, I] (bf16) → down GEMM.
Both layouts; activations bf16 (fp16/fp32), fp8 (+ per-128 scales) or nvfp4 (dequantised on load).
Weights: the NVFP4 tensors as stored (uint8 bytes, e4m3 scales viewed as bytes), no repack.

Config (0 = chosen from the expected tokens per expert): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
num_warps, num_stages for both GEMMs; SPLIT_K for the down GEMM (atomic fp32 accumulation);
SPLIT_NIBBLES=1 permutes K (even elements, then odd) so that the unpacked nibbles feed two dots
directly instead of being interleaved; MMA_FP16=1 runs the MMA in fp16 for bf16/fp8 activations
(scaled by 2^-8 on load; the dequantised weights are exact in fp16, which saves their bf16
conversion in the main loop); UNPACK16=1 unpacks the nibbles with 16-bit integer ops (no per-element
int32 → int16 truncation).
"""

from __future__ import annotations

import os

import torch

from pdlab.kernels import registry
from pdlab.moe.layouts import Masked

_DEFAULT = {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 8, "num_warps": 0, "num_stages": 0, "SPLIT_K": 1,
            "SPLIT_NIBBLES": 0, "MMA_FP16": 0, "UNPACK16": 0}
_SPACE = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256, 512],
          "GROUP_M": [1, 4, 8, 16], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5], "SPLIT_K": [1, 2, 4],
          "SPLIT_NIBBLES": [0, 1], "MMA_FP16": [0, 1],
          "UNPACK16": [0, 1]}


def _probe() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return None
    return "needs a CUDA GPU (or TRITON_INTERPRET=1 for CPU tests)"


def heuristic_config(expected_m: int, interpret: bool = False) -> dict:
    """Defaults by tokens per expert: decode streams weights (small BLOCK_M, wide BLOCK_K), prefill
    is a compute-bound tiled GEMM."""
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    # measured on H200 (bench/results/NVIDIA_H200/moe_experts): BLOCK_K 128 beat 256/512 at 16 tokens
    if expected_m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if expected_m <= 64:
        return {"BLOCK_M": 32 if expected_m <= 32 else 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


@registry.register_backend("moe_experts", "triton", archs=("cuda",), packages=("triton",), probe=_probe,
                           priority=20, config_space=_SPACE, default_config=_DEFAULT,
                           options={"layouts": ("contiguous", "masked"), "payloads": ("bf16", "fp8", "nvfp4"),
                                    "weights": ("nvfp4",), "interpretable": True})
def run_triton(layout, weights, *, config):
    """NVFP4 W4A16 experts: fused gate_up+SiLU·mul GEMM, then down GEMM."""
    from pdlab.moe.triton.nvfp4_moe import A_FLOAT, A_FP8, A_NVFP4, moe_nvfp4_gemm

    if not weights.has_nvfp4:
        raise ValueError("moe_experts[triton] runs NVFP4 weights: build them with "
                         "ExpertWeights.from_bf16(..., quantize=True) or from_modelopt(...)")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = dict(config)
    auto = heuristic_config(cfg.pop("_expected_m", 16), interpret)
    cfg = {k: (auto.get(k, v) if v == 0 else v) for k, v in cfg.items()}
    w = weights.prepare("triton", _repack)
    x = layout.hidden
    masked = isinstance(layout, Masked)
    counts = layout.masked_m if masked else layout.counts
    offsets = None if masked else layout.offsets
    if layout.payload == "bf16":
        kind, mma, inter = A_FLOAT, x.dtype, x.dtype
    else:
        kind = A_FP8 if layout.payload == "fp8" else A_NVFP4
        mma = torch.float32 if interpret else (torch.float16 if kind == A_NVFP4 else torch.bfloat16)
        inter = torch.float32 if interpret else torch.bfloat16
    if cfg.get("MMA_FP16") and kind != A_NVFP4:
        mma = torch.float16
    elif interpret and mma == torch.bfloat16:
        mma = torch.float32  # the interpreter's bf16 dot is not exact
    a_sf = layout.scales
    if a_sf is not None and kind == A_NVFP4:
        a_sf = a_sf.view(torch.uint8)
    if kind == A_FP8:
        x = x.view(torch.uint8)
    a_gs = None
    if kind == A_NVFP4:
        a_gs = layout.global_scale.float().reshape(-1).contiguous()
    H, I = weights.hidden_size, weights.intermediate_size
    lead = x.shape[:-1]
    h = torch.empty(lead + (I,), dtype=inter, device=x.device)
    moe_nvfp4_gemm(x, kind, a_sf, a_gs, w["w13"], w["w13_sf"], w["w13_s2"], h, counts, offsets, masked=masked,
                   n=I, k=H, fuse_silu=True, mma_dtype=mma, cfg=cfg)
    out_dtype = layout.hidden.dtype if layout.payload == "bf16" else torch.bfloat16
    split = cfg.get("SPLIT_K", 1) > 1
    out = (torch.zeros if split else torch.empty)(lead + (H,), dtype=torch.float32 if split else out_dtype,
                                                  device=x.device)
    moe_nvfp4_gemm(h, A_FLOAT, None, None, w["w2"], w["w2_sf"], w["w2_s2"], out, counts, offsets, masked=masked,
                   n=H, k=I, fuse_silu=False, cfg=cfg,
                   mma_dtype=torch.float16 if cfg.get("MMA_FP16") else (torch.float32 if interpret else inter))
    return out.to(out_dtype) if split else out


def _repack(w) -> dict:
    return {"w13": w.w13_weight.contiguous(), "w13_sf": w.w13_weight_scale.contiguous().view(torch.uint8),
            "w13_s2": w.w13_weight_scale_2.float().contiguous(),
            "w2": w.w2_weight.contiguous(), "w2_sf": w.w2_weight_scale.contiguous().view(torch.uint8),
            "w2_s2": w.w2_weight_scale_2.float().contiguous()}
