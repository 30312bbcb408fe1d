"""Backend `triton` of op `nvfp4_quantize`: row-wise [M, K] and masked grouped [E, M, K] NVFP4
quantization in one Triton kernel (kernels/triton/_nvfp4_quant_kernel.py), bit-exact with the
torch reference on GPU and under the CPU interpreter (TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

import math
import os

import torch

from pdlab.kernels.registry import register_backend


def _probe() -> str | None:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "on CPU only under the Triton interpreter (set TRITON_INTERPRET=1 before starting; tests do)"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_config(rows: int, k: int) -> dict:
    """The launch config used when none is given: 4 x 512 tiles on 2 warps (32 elements per thread;
    the best of the sweep on H200, bench/results/NVIDIA_H200/quantize), fewer rows and warps for
    few-row (decode) inputs."""
    block_m = min(4, _next_pow2(rows))
    block_k = max(16, min(512, _next_pow2(k)))
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_warps": max(1, min(2, block_m * block_k // 1024))}


@register_backend(
    "nvfp4_quantize", "triton", archs=("cpu", "cuda"), packages=("triton",), probe=_probe, priority=50,
    config_space={"BLOCK_M": [1, 2, 4, 8, 16, 32], "BLOCK_K": [16, 32, 64, 128, 256, 512, 1024, 2048],
                  "num_warps": [1, 2, 4, 8], "TILES_K": [1, 2, 4, 7], "num_stages": [1, 2, 3, 4]},
    default_config={"BLOCK_M": 4, "BLOCK_K": 512, "num_warps": 2},
    options={"swizzle": True, "masked": True, "input_dtypes": ("bf16", "fp16", "fp32")},
)
def quantize_triton(x: torch.Tensor, global_scale: torch.Tensor, masked_m: torch.Tensor | None = None, *,
                    swizzle: bool = False, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton NVFP4 quantization; called through `pdlab.kernels.nvfp4.quantize` (which checks inputs).

    Args:
        x: [R, K] or [E, M, K] (masked) bf16 | fp16 | fp32, stride(-1) == 1, K % 16 == 0.
        global_scale: fp32 [1] (one for all rows) or [lead] (one per index of x's first dim).
        masked_m: [E] int32 or None; rows m >= masked_m[e] are written as zero bytes / zero scales.
        swizzle: write the scales in the 128x4 layout [(E,) ceil(M/128), ceil(K/64), 32, 4, 4].
        config: BLOCK_M, BLOCK_K, num_warps (defaults from `default_config`); TILES_K (K-tiles per
            program, looped; default 1) and num_stages (software pipelining of that loop).
    Returns: packed [..., K/2] uint8, scales [..., K/16] (or swizzled) float8_e4m3fn.
    Graph-safe: yes (no host sync; allocates its outputs)."""
    from pdlab.kernels.triton._nvfp4_quant_kernel import nvfp4_quant_kernel

    K = x.shape[-1]
    R = math.prod(x.shape[:-1])
    x2 = x if x.dim() == 2 else x.reshape(R, K)  # a view unless the leading dims cannot merge
    groups = x.shape[0] if x.dim() >= 3 else 1  # grid axis 2; masked_m and swizzle tiles are per group
    M = R // groups if groups else 0
    cfg = default_config(M, K)
    cfg.update(config or {})
    k16 = K // 16
    packed = torch.empty((*x.shape[:-1], K // 2), dtype=torch.uint8, device=x.device)
    if swizzle:
        mt, kt = (M + 127) // 128, (k16 + 3) // 4
        alloc = torch.zeros if (M % 128 or k16 % 4) else torch.empty
        scales = alloc((*x.shape[:-2], mt, kt, 32, 4, 4), dtype=torch.uint8, device=x.device)
    else:
        scales = torch.empty((*x.shape[:-1], k16), dtype=torch.uint8, device=x.device)
        kt = 0
    gs_mode = 0 if global_scale.numel() == 1 else (2 if x.dim() == 2 else 1)
    in_kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[x.dtype]
    if R == 0 or K == 0:  # nothing to launch (and an empty row has no word view)
        return packed, scales.view(torch.float8_e4m3fn)
    words = _as_pairs(x2, torch.int64 if in_kind == 2 else torch.int32)
    offs_64 = max(words.stride(0) * R, scales.numel()) >= 2**31 - 2**20  # element offsets need 64 bits
    tiles_k = cfg.get("TILES_K", 1)
    grid = (_cdiv(M, cfg["BLOCK_M"]), _cdiv(K, cfg["BLOCK_K"] * tiles_k), groups)
    nvfp4_quant_kernel[grid](
        words, global_scale, masked_m if masked_m is not None else global_scale, packed, scales,
        M, K, words.stride(0), kt,
        IN_KIND=in_kind, GS_MODE=gs_mode, HAS_MASK=masked_m is not None, SWIZZLE=swizzle, OFFS_64=offs_64,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], TILES_K=tiles_k, num_warps=cfg["num_warps"],
        **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}))
    return packed, scales.view(torch.float8_e4m3fn)


def _as_pairs(x2: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """[R, K] 16- or 32-bit elements -> [R, K/2] words of two elements (a view when aligned)."""
    try:
        return x2.view(word)
    except RuntimeError:  # row stride or offset not word-aligned
        return x2.contiguous().view(word)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
