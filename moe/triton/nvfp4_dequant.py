"""NVFP4 expert weights → bf16, one pass (the dense prefill path of the triton runner).

    out[e, n, k] = bf16(code(w[e, n, k/2]) · e4m3(sf[e, n, k/16]) · s2[e])

with the arithmetic of `ExpertWeights.dequantized(torch.bfloat16)` (value · (scale / (1/s2)) in fp32, one
rounding to bf16), so the result equals it bit for bit. Memory-bound: reads 0.5625 B/param, writes 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdlab.moe.triton.nvfp4_moe import _e4m3_to_f32, _nibbles_f16
from pdlab.moe.triton.tiled import tiled_cols, tiled_rows


@triton.jit
def _nvfp4_to_bf16(w_ptr, sf_ptr, s2_ptr, out_ptr, R, rows_per_expert, KH,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILED: tl.constexpr = False,
                   FRAG: tl.constexpr = False):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    cs = c0 // 8 + tl.arange(0, BLOCK_C // 8)
    r_mask = r < R
    r64 = r.to(tl.int64)
    if TILED:  # tile_nvfp4 layout (moe/triton/tiled.py)
        w_row, sf_row = tiled_rows(r64, KH)
        w_col, sf_col = tiled_cols(c, cs)
        w_off = w_row[:, None] + w_col[None, :]
        sf_off = sf_row[:, None] + sf_col[None, :]
    elif FRAG:  # fragment order (moe/triton/nvfp4_frag.py): model columns 2c and 2c + 1 sit in two bytes
        w_row, sf_row = _frag_rows(r64, KH)
        w_col, shift, sf_col = _frag_cols(c, cs)
        w_off = w_row[:, None] + w_col[None, :]
        sf_off = sf_row[:, None] + sf_col[None, :]
    else:
        w_off = r64[:, None] * KH + c[None, :]
        sf_off = r64[:, None] * (KH // 8) + cs[None, :]
    if FRAG:  # the nibble of column 2c from byte u = 0, of column 2c + 1 from byte u = 1: one plain byte
        b_lo = tl.load(w_ptr + w_off, mask=r_mask[:, None], other=0).to(tl.int32)
        b_hi = tl.load(w_ptr + w_off + 1, mask=r_mask[:, None], other=0).to(tl.int32)
        b = ((b_lo >> shift[None, :]) & 0xF) | (((b_hi >> shift[None, :]) & 0xF) << 4)
    else:
        b = tl.load(w_ptr + w_off, mask=r_mask[:, None], other=0)
    sf = tl.load(sf_ptr + sf_off, mask=r_mask[:, None], other=0)
    s2 = tl.load(s2_ptr + r // rows_per_expert, mask=r_mask, other=0.0)
    # code → value · 2^-14 (exact), e4m3 → the scale (exact)
    lo, hi = _nibbles_f16(b)
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    s = _e4m3_to_f32(sf)
    # value · (scale / (1/s2)) as the reference computes it (IEEE division), then one bf16 rounding
    f = tl.math.div_rn(s, tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s2)[:, None]) * 16384.0
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_R, BLOCK_C // 8, 8)), (BLOCK_R, BLOCK_C))
    v = tl.reshape(tl.join(lo * f, hi * f), (BLOCK_R, 2 * BLOCK_C)).to(tl.bfloat16)
    cc = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
    tl.store(out_ptr + r64[:, None] * (2 * KH) + cc[None, :], v, mask=r_mask[:, None])


@triton.jit
def _frag_rows(r64, KH):
    """Byte and scale offsets of global weight rows r (over E·N, N % 128 == 0) in fragment order: row
    16w + rlo + 8·rsel + 64·rhi of its 128-row tile is thread 32w + 4·rlo (+ q) at byte 2·rsel + 32·rhi (+ …)."""
    rt = r64 // 128
    rr = r64 % 128
    KT = KH // 64
    lane_row = 32 * ((rr // 16) % 4) + 4 * (rr % 8)
    w_row = rt * KT * 8192 + (rr // 64) * 4096 + lane_row * 16 + 2 * ((rr // 8) % 2)
    sf_row = rt * KT * 1024 + lane_row * 8 + (rr // 8) % 2 + 4 * (rr // 64)
    return w_row, sf_row


@triton.jit
def _frag_cols(c, cs):
    """For plain byte columns c (model columns 2c, 2c + 1): the fragment-order byte offset of column 2c (column
    2c + 1 is the next byte), the shift of their nibble, and for scale blocks cs the scale's offset. Model column
    k' = 32q + 4c' + 2n + u of a tile is byte u + 4·(c' % 4) of thread q's 16-byte run c' // 4, nibble n."""
    k = 2 * c
    kp = k % 128
    cc = (kp // 4) % 8
    w_col = (k // 128) * 8192 + (cc // 4) * 2048 + (kp // 32) * 16 + 4 * (cc % 4)
    shift = 4 * ((kp // 2) % 2)
    bl = cs % 8
    sf_col = (cs // 8) * 1024 + (bl // 2) * 8 + 2 * (bl % 2)
    return w_col, shift, sf_col


def nvfp4_to_bf16(w: torch.Tensor, sf: torch.Tensor, s2: torch.Tensor, out: torch.Tensor | None = None, *,
                  tiled: bool = False, frag: bool = False) -> torch.Tensor:
    """Dequantise NVFP4 expert weights to bf16.

    w: [E, N, K/2] uint8 (low nibble = even k), contiguous; sf: [E, N, K/16] uint8 (e4m3 bits), contiguous;
    s2: [E] fp32 (weight_scale_2); out: [E, N, K] bf16 (allocated when None). K/2 a multiple of 16.
    tiled: w and sf are in the layout of `pdlab.moe.weights.tile_nvfp4` (N % 16 == 0, K % 128 == 0).
    frag: w and sf hold the bytes of `pack_weights` / `pack_scales` (moe/triton/nvfp4_frag.py) in these shapes
    (N and K multiples of 128).
    Returns out (always the plain [E, N, K] order). Graph-safe (no host sync)."""
    E, N, KH = w.shape
    if tiled and (N % 16 or KH % 64):
        raise ValueError(f"nvfp4_to_bf16: tiled weights need N % 16 == 0 and K % 128 == 0, got N={N}, K={2 * KH}")
    if frag and (N % 128 or KH % 64):
        raise ValueError(f"nvfp4_to_bf16: fragment-order weights need N and K multiples of 128, got N={N}, "
                         f"K={2 * KH}")
    if out is None:
        out = torch.empty((E, N, 2 * KH), dtype=torch.bfloat16, device=w.device)
    bc = 256
    while bc > 16 and KH % bc:
        bc //= 2
    if KH % bc:
        raise ValueError(f"nvfp4_to_bf16: K/2={KH} must be a multiple of 16")
    R = E * N
    br = 16
    _nvfp4_to_bf16[(triton.cdiv(R, br), KH // bc)](w, sf, s2, out, R, N, KH, BLOCK_R=br, BLOCK_C=bc, TILED=tiled,
                                                   FRAG=frag, num_warps=4)
    return out
