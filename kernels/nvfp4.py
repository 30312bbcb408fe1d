"""NVFP4 format: reference quantize / dequantize (modelopt semantics) and the 128x4 scale swizzle.

Format (ANCHORS.md): elements are E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code = sign<<3 |
index), two per byte with the low nibble holding the even element; one FP8 E4M3 scale per 16
consecutive elements along K; one FP32 global scale per tensor (or per expert).

pdlab's `global_scale` is the multiplier applied before quantization, 448·6 / amax, i.e.
1 / weight_scale_2 for modelopt weights and 1 / input_scale for activations. The exact arithmetic
(fp32, IEEE division, round-to-nearest-even everywhere), which the Triton kernel reproduces bit for
bit::

    amax_b  = max |x| over the 16-element block                      (fp32)
    sf      = e4m3( min((amax_b / 6) * global_scale, 448) )            (RNE cast)
    mult    = global_scale / float(sf)       (0 when sf == 0)
    code    = e2m1_rne(x * mult)             (saturating at 6, sign kept, -0 stays -0)

Dequantization: x ≈ value(code) · float(sf) / global_scale.

Non-finite inputs (values, so no check without a device sync): an infinite element saturates its
block's scale to 448 and its own code to ±6; a block holding a NaN gets the NaN scale (e4m3 0x7F)
and sign-only codes, so it dequantises to NaN: a NaN is never turned into a finite value.
"""

from __future__ import annotations

import torch

from pdlab.kernels.contracts import Op, Spec, is_scale
from pdlab.kernels.registry import register_backend

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; `strict[i]` says the midpoint itself rounds up
# (round-to-nearest-even: a tie goes to the even code).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)

QUANTIZE = Op(
    "nvfp4_quantize",
    inputs={
        "x": Spec("... K", "bf16|fp16|fp32", last_dim_contiguous=True),
        "masked_m": Spec("E", "int32", optional=True),
    },
    outputs={"packed": Spec("... K/2", "uint8"), "scales": Spec("... K/16", "fp8_e4m3")},
    hints={"x": "NVFP4 quantizes along the last dim in blocks of 16: K must be a multiple of 16 "
                "(pad the hidden size, or keep this tensor in bf16)."},
)
# The same op when masked_m is given: grouped input only.
QUANTIZE_MASKED = Op(
    "nvfp4_quantize",
    inputs={
        "x": Spec("E M K", "bf16|fp16|fp32", layout="masked", last_dim_contiguous=True),
        "masked_m": Spec("E", "int32"),
    },
    outputs={"packed": Spec("E M K/2", "uint8"), "scales": Spec("E M K/16", "fp8_e4m3")},
    hints={"x": lambda problem, value, dims: (
        "masked_m means grouped input [E, M_max, K] (low-latency dispatch output); a 2-D [N, K] input "
        "is the contiguous layout: quantize it without masked_m." if "dims" in problem else
        "NVFP4 quantizes along the last dim in blocks of 16: K must be a multiple of 16.")},
)

_SCALES_HINT = ("scales are the row-major block scales [..., K/16] quantize returned with these bytes (swizzled "
                "scales: unswizzle_scales_128x4(scales, M, K/16) first).")
DEQUANTIZE = Op(
    "nvfp4_dequantize",
    inputs={"packed": Spec("... K/2", "uint8"), "scales": Spec("... K/16")},
    hints={"packed": "packed holds two E2M1 codes per uint8 byte [..., K/2], as quantize returns it (a "
                     "torch.float4_e2m1fn_x2 tensor: from_torch_fp4(t)).",
           "scales": _SCALES_HINT},
)


def nvfp4_size_problem(hidden_size: int, intermediate_size: int) -> str | None:
    """Which of a MoE model's sizes NVFP4 expert weights cannot hold, with the reason, else None: both GEMMs
    quantize along the hidden and the (MoE) intermediate size in blocks of 16."""
    bad = [f"{name}={value}" for name, value in (("hidden_size", hidden_size),
                                                 ("moe_intermediate_size", intermediate_size)) if value % BLOCK]
    if not bad:
        return None
    verb = "is" if len(bad) == 1 else "are"
    return (f"{' and '.join(bad)} {verb} not a multiple of {BLOCK}: NVFP4 expert weights are quantized in blocks of "
            f"{BLOCK} along both sizes")


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """448·6 / amax as fp32 (amax of 0 gives scale 1). amax: scalar or [E] fp32 → same shape fp32, >= 0.
    A host number that is negative, NaN or inf is a ValueError (an amax is a largest absolute value)."""
    if not isinstance(amax, torch.Tensor) and not is_scale(amax, zero_ok=True):
        raise ValueError(f"global_scale_from_amax: amax={amax!r} is no absolute maximum: pass max(|x|), a "
                         "finite number >= 0")
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled) → E2M1 codes as uint8 in [0, 15], RNE, saturating at ±6.

    y: any shape, fp32 → same shape, uint8."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for mid, up in zip(_MIDPOINTS, _TIE_ROUNDS_UP):
        code += (a >= mid if up else a > mid).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 15], any shape) → values of `dtype`, same shape."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=code.device)
    return table[code.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes → [..., K/2] uint8, low nibble = even element."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 → [..., K] uint8 codes (even element from the low nibble)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _host_global_scale(value: object) -> float:
    """A global scale given as a host number, as a float; ValueError unless it is a finite number > 0 (checked for
    free; a tensor's value is not read, that would be a device sync)."""
    if is_scale(value):
        return float(value)
    raise ValueError(f"global_scale is {value!r}; it must be a finite number > 0 (448·6/amax: "
                     "global_scale_from_amax(amax) gives it; 0 dequantises to NaN, a negative scale to zeros)")


def _expand_global_scale(global_scale: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(global_scale, torch.Tensor):
        global_scale = _host_global_scale(global_scale)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() == 1:
        return gs.reshape(())
    if gs.dim() == 1 and x.dim() >= 2 and gs.shape[0] == x.shape[0]:
        return gs.view(-1, *([1] * (x.dim() - 1)))  # one global scale per expert / group
    raise ValueError(f"global_scale must be a scalar or one value per leading index ([{x.shape[0]}]), "
                     f"got shape {list(gs.shape)}")


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float,
                   masked_m: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference NVFP4 quantization (torch, exact semantics in the module docstring).

    Args:
        x: [..., K] bf16 | fp16 | fp32, K a multiple of 16; 1-D, 2-D [M, K] or grouped [E, M, K].
        global_scale: fp32 scalar (a finite number > 0, 0-d or 1-element tensor), or [E] (one per leading
            index) for grouped input.
        masked_m: optional [E] int32 for grouped [E, M, K] input: rows m >= masked_m[e] are not
            quantized and come back as zero bytes / zero scales.
    Returns:
        packed: [..., K/2] uint8, low nibble = even element.
        scales: [..., K/16] float8_e4m3fn, row-major (not swizzled; see `swizzle_scales_128x4`).
    """
    if masked_m is None:
        QUANTIZE.check("torch", x=x)
    else:
        QUANTIZE_MASKED.check("torch", masked_m=masked_m, x=x)
    _check_k(x, "torch")
    gs = _expand_global_scale(global_scale, x)
    xf = x.float()
    blocks = xf.unflatten(-1, (-1, BLOCK))  # [..., K/16, 16]
    amax = blocks.abs().amax(dim=-1)  # [..., K/16]
    gs_b = gs  # scalar, or [E, 1, ...] matching amax's dims
    # NOTE: divide by a device tensor, not a Python number: CUDA turns `t / scalar` into
    # `t * (1 / scalar)`, which is not the IEEE division this format is defined with.
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device)
    sf = torch.clamp((amax / six) * gs_b, max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.float()
    mult = torch.where(sf_f > 0, gs_b / sf_f, torch.zeros_like(sf_f))
    codes = e2m1_encode(blocks * mult.unsqueeze(-1)).flatten(-2)
    packed = pack_e2m1(codes)
    if masked_m is not None:
        keep = torch.arange(x.shape[1], device=x.device)[None, :] < masked_m.to(x.device).long()[:, None]
        packed = packed * keep[..., None].to(torch.uint8)
        sf = torch.where(keep[..., None], sf.float(), 0.0).to(torch.float8_e4m3fn)
    return packed, sf


def quantize(x: torch.Tensor, global_scale: torch.Tensor | float, masked_m: torch.Tensor | None = None, *,
             swizzle: bool = False, backend: str | None = None,
             config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize `x` with the best usable backend (or `backend`), bit-exact with `quantize_nvfp4`.

    Args:
        x: [..., K] bf16 | fp16 | fp32, stride(-1) == 1, K a multiple of 16 (1-D, [M, K] or [E, M, K]).
        global_scale: fp32 tensor with 1 element, or [x.shape[0]] (one per expert / leading index),
            on x's device; a Python number (finite, > 0) is turned into a tensor (one small copy: pass a tensor
            when capturing CUDA graphs).
        masked_m: optional [E] int32 on x's device, x then [E, M_max, K]: rows m >= masked_m[e] are
            not read and come back as zero bytes and zero scales.
        swizzle: return the scales in the 128x4 layout ([(E,) ceil(M/128), ceil(K/64), 32, 4, 4],
            padding zero) instead of row-major; 2-D and 3-D x only.
        backend: a registered backend name ("torch", "triton"); default: the preferred usable one.
        config: launch knobs of that backend (see `registry.get_backend("nvfp4_quantize", name)`);
            default: the tuned config for this device and shape if one is stored, else the backend's
            own shape-aware default.
    Returns:
        packed: [..., K/2] uint8, low nibble = even element.
        scales: [..., K/16] float8_e4m3fn (or the swizzled shape above).
    NaN / Inf in x: as the reference (module docstring): a block holding a NaN dequantises to NaN.
    Graph-safe: with a tensor global_scale, yes for the triton backend."""
    from pdlab.kernels import registry

    chosen = registry.select(QUANTIZE.name, backend, device=x.device if isinstance(x, torch.Tensor) else None)
    if masked_m is None:
        QUANTIZE.check(chosen.name, x=x)
    else:
        QUANTIZE_MASKED.check(chosen.name, masked_m=masked_m, x=x)
    _check_k(x, chosen.name)
    if swizzle and x.dim() not in (2, 3):
        QUANTIZE.require(chosen.name, False, "x", "must be 2-D or 3-D for swizzled scales", x, "[M, K] or [E, M, K]")
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.full((1,), _host_global_scale(global_scale), dtype=torch.float32, device=x.device)
    lead = x.shape[0] if x.dim() >= 2 else 1
    QUANTIZE.require(chosen.name, global_scale.dtype == torch.float32 and global_scale.numel() in (1, lead)
                     and global_scale.device == x.device, "global_scale", "does not fit", global_scale,
                     f"fp32 with 1 or {lead} elements on {x.device}",
                     "pass torch.tensor([448*6/amax], dtype=torch.float32, device=x.device), or one per expert")
    if config is not None:
        chosen.config(config)  # rejects unknown knobs
    elif chosen.config_space:
        from pdlab.kernels.tuned import resolve_config

        rows = x.numel() // x.shape[-1] if x.numel() else 0
        tuned, source = resolve_config(QUANTIZE.name, chosen.name, {"M": rows, "K": x.shape[-1]}, device=x.device)
        config = tuned if source != "default" else None  # None: the backend's shape-aware default
    return chosen.impl(x, global_scale, masked_m, swizzle=swizzle, config=config)


@register_backend(QUANTIZE.name, "torch", archs=("cpu", "cuda"), priority=0, reference=True)
def _quantize_torch(x: torch.Tensor, global_scale: torch.Tensor, masked_m: torch.Tensor | None = None, *,
                    swizzle: bool = False, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (`quantize_nvfp4`) behind the op interface; swizzles afterwards when asked."""
    gs = global_scale.reshape(()) if global_scale.numel() == 1 else global_scale
    packed, scales = quantize_nvfp4(x, gs, masked_m)
    return packed, swizzle_scales_128x4(scales) if swizzle else scales


def _check_k(x: torch.Tensor, backend: str) -> None:
    QUANTIZE.require(backend, x.shape[-1] % BLOCK == 0, "x", f"has K={x.shape[-1]}, not a multiple of {BLOCK}",
                     x, "[..., K] with K % 16 == 0")


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | float,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization.

    Args:
        packed: [..., K/2] uint8. scales: [..., K/16] (packed's leading dims) float8_e4m3fn (row-major; uint8
            bytes are read as e4m3) or any other dtype holding the scale values. global_scale: fp32 scalar (a
            finite number > 0, or a tensor) or [E] (one per leading index).
    Returns: [..., K] of `dtype` (computed in fp32).
    Raises ShapeError when packed is not uint8 or the scales do not fit its shape (e.g. swizzled ones).
    """
    dims = DEQUANTIZE.check(None, packed=packed, scales=scales)
    DEQUANTIZE.require(None, scales.shape[:-1] == packed.shape[:-1], "scales", "has other leading dims than "
                       "packed", scales, f"[{', '.join(map(str, packed.shape[:-1]))}, K/16={dims['K'] // BLOCK}]")
    values = e2m1_decode(unpack_e2m1(packed))  # [..., K] fp32
    sf = scales.float() if scales.dtype != torch.uint8 else scales.view(torch.float8_e4m3fn).float()
    gs = _expand_global_scale(global_scale, values)
    out = values.unflatten(-1, (-1, BLOCK)) * (sf / gs).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def quantize_weight_modelopt(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a bf16/fp32 weight [(E,) N, K] the way modelopt writes NVFP4 checkpoints.

    Returns {"weight": [(E,) N, K/2] uint8, "weight_scale": [(E,) N, K/16] float8_e4m3fn,
    "weight_scale_2": fp32 scalar, or [E] for stacked experts}; weight_scale_2 = amax / (6·448)."""
    if w.dim() == 3:
        amax = w.float().abs().amax(dim=(1, 2))
    else:
        amax = w.float().abs().amax()
    gs = global_scale_from_amax(amax)
    packed, sf = quantize_nvfp4(w, gs)
    return {"weight": packed, "weight_scale": sf, "weight_scale_2": (1.0 / gs).float()}


# ---------------------------------------------------------------------------------------------
# 128x4 scale swizzle (sm100 block-scaled GEMMs)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales → the "128x4" swizzled layout.

    Args: scales: [M, K16] or [L, M, K16], any 1-byte or float dtype.
    Returns: [(L,) ceil(M/128), ceil(K16/4), 32, 4, 4], same dtype, padding zero-filled. In flat
    order the element for (m, k) sits at mTile·(numKTiles·512) + kTile·512 + (m%32)·16 +
    ((m%128)/32)·4 + (k%4)."""
    if scales.dim() not in (2, 3):
        raise ValueError(f"swizzle_scales_128x4: scales must be [M, K16] or [L, M, K16] (one scale per 16 "
                         f"elements of each row), got {scales.dim()}-D {tuple(scales.shape)}")
    batched = scales.dim() == 3
    s = scales if batched else scales.unsqueeze(0)
    L, M, K16 = s.shape
    Mp, Kp = _round_up(M, 128), _round_up(K16, 4)
    padded = torch.zeros((L, Mp, Kp), dtype=s.dtype, device=s.device)
    padded[:, :M, :K16] = s
    # m = mt*128 + i*32 + j ; k = kt*4 + l  →  [mt, kt, j, i, l]
    out = padded.view(L, Mp // 128, 4, 32, Kp // 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return out if batched else out[0]


def unswizzle_scales_128x4(swizzled: torch.Tensor, m: int, k16: int) -> torch.Tensor:
    """Inverse of `swizzle_scales_128x4`: [(L,) mt, kt, 32, 4, 4] (or its flat view per batch) →
    [(L,) m, k16], dropping the padding."""
    Mp, Kp = _round_up(m, 128), _round_up(k16, 4)
    if swizzled.dim() not in (1, 2, 5, 6):
        raise ValueError(f"unswizzle_scales_128x4: swizzled must be [(L,) mt, kt, 32, 4, 4] or its flat view "
                         f"[(L,) mt*kt*512], got {swizzled.dim()}-D {tuple(swizzled.shape)}")
    batched = swizzled.dim() in (2, 6)
    s = swizzled if batched else swizzled.unsqueeze(0)
    L = s.shape[0]
    if s[0].numel() != Mp * Kp:
        raise ValueError(f"unswizzle_scales_128x4: m={m}, k16={k16} need {Mp * Kp} scales per batch "
                         f"(M and K16 padded to {Mp} x {Kp}), the tensor holds {s[0].numel()} "
                         f"({tuple(swizzled.shape)}): pass the m and k16 it was swizzled from")
    s = s.reshape(L, Mp // 128, Kp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(L, Mp, Kp)
    out = s[:, :m, :k16].contiguous()
    return out if batched else out[0]


def swizzled_offset(m: int, k: int, k16: int) -> int:
    """Flat offset of scale (m, k) in the 128x4 layout of a [M, k16] scale matrix (the formula)."""
    num_k_tiles = _round_up(k16, 4) // 4
    return (m // 128) * (num_k_tiles * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)


# ---------------------------------------------------------------------------------------------
# interop with torch's own fp4 / fp8 dtypes


def as_torch_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 → the same bytes viewed as torch.float4_e2m1fn_x2 (where torch has it)."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        raise RuntimeError(f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype (added in 2.8)")
    return packed.view(torch.float4_e2m1fn_x2)


def from_torch_fp4(t: torch.Tensor) -> torch.Tensor:
    """torch.float4_e2m1fn_x2 [..., K/2] → uint8 bytes [..., K/2] (no copy)."""
    return t.view(torch.uint8)


# The other backends register themselves on import (their heavy packages load only when they run).
import pdlab.kernels.triton.nvfp4_quant  # noqa: E402,F401
