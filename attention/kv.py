"""FP8 (e4m3) latent-cache helpers: the byte format of uint8 KV pools.

A uint8 pool holds e4m3 bytes; the value of a byte is float(byte as e4m3) * kv_scale, with one
per-tensor fp32 scale. Quantization divides by the scale, saturates to ±448 (the e4m3 range) and
rounds to nearest even.
"""

from __future__ import annotations

import torch

from pdlab.kernels.contracts import is_scale

FP8_MAX = 448.0


def _scale_value(kv_scale: float | torch.Tensor, device: torch.device) -> torch.Tensor | float:
    """The scale as the arithmetic takes it; ValueError for a tensor of more than one value and for a host number
    that is not finite and > 0 (a tensor's value is not read: that would be a device sync)."""
    if isinstance(kv_scale, torch.Tensor):
        if kv_scale.numel() != 1:
            raise ValueError(f"kv_scale must be a number or a tensor of 1 element (the per-tensor fp8 scale), got "
                             f"{list(kv_scale.shape)} {kv_scale.dtype}")
        return kv_scale.to(device=device, dtype=torch.float32).reshape(())
    if not is_scale(kv_scale):
        raise ValueError(f"kv_scale is {kv_scale!r}; it must be a finite number > 0 (value = e4m3 * kv_scale: 0 "
                         "saturates every byte, a negative scale flips signs): pass the pool's scale, e.g. "
                         "fp8_scale_for(x), or 1.0")
    return float(kv_scale)


def quantize_kv_fp8(x: torch.Tensor, kv_scale: float | torch.Tensor) -> torch.Tensor:
    """Quantize latent rows to fp8_e4m3 bytes.

    Args:
        x: [..., 576] (any shape) bf16 | fp16 | fp32.
        kv_scale: per-tensor dequant scale: a finite number > 0, or a 0-dim/1-element fp32 tensor.
    Returns: uint8 tensor of x's shape holding e4m3(x / kv_scale), saturated to ±448.
    Raises ValueError for a scale of several values or a host number that is not finite and > 0."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError("quantize_kv_fp8 needs torch with float8_e4m3fn (torch >= 2.1)")
    scale = _scale_value(kv_scale, x.device)
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_kv_fp8(data: torch.Tensor, kv_scale: float | torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_kv_fp8`.

    Args:
        data: uint8 (e4m3 bytes) or float8_e4m3fn tensor, any shape [...] (a pool is [P, page, 576]).
        kv_scale: the scale the bytes were written with (as in `quantize_kv_fp8`).
        dtype: output dtype (fp32 by default).
    Returns: float tensor of data's shape = float(e4m3) * kv_scale."""
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    elif data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_kv_fp8 expects uint8 or float8_e4m3fn bytes, got {data.dtype}")
    return (data.float() * _scale_value(kv_scale, data.device)).to(dtype)


def fp8_scale_for(x: torch.Tensor, margin: float = 1.0) -> float:
    """A per-tensor scale mapping max|x| of x [...] (any shape, any float dtype) to the e4m3 range (host sync; for setup
    code, not hot paths)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return max(amax * margin / FP8_MAX, 1e-12)
