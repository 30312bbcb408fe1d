"""NVFP4 W4A16 grouped GEMM for MoE experts (Hopper / any CUDA GPU; runs under TRITON_INTERPRET).

One kernel, two uses: gate_up (two weight tiles per program, SiLU·mul fused in the epilogue) and
down. Weights stay NVFP4 in HBM (0.5625 B/param) and are dequantised in the main loop:

    code (4 bits) → fp16 bits by shifts: s<<15 | e<<10 | m<<9  = value · 2^-14 (exact, subnormals too)
    e4m3 scale   → fp16 bits by shifts: s<<15 | em<<7         = value · 2^-8, ·256 in fp32
    w' = value · scale · 2^-14 (exact in fp16 and bf16: ≤ 6 significant bits)

and the 2^14 (and weight_scale_2, and 1/global_scale of NVFP4 activations) go into the per-expert
alpha of the epilogue. DEQ_ASM (GPU, sm89+): 8 nibbles per 32-bit register to e4m3 bytes, hardware
e4m3x2 → f16x2 conversion, scale in f16x2 (value·scale·2^-6, alpha ·64). PERM_K: the MMA's K order is
permuted within each 32-element group (_perm_bytes / _perm_k) so that each thread's weight bytes are
contiguous in shared memory; weights and activations get the same permutation, the sum is unchanged.
The MMA runs swapped (acc[BLOCK_N, BLOCK_M] = W' · Aᵀ) so that decode's handful of tokens is the MMA's
narrow side.

TILED: the weights (and scales) come in the layout of `pdlab.moe.weights.tile_nvfp4`, each 16-row ×
128-element tile stored as 1024 contiguous bytes (scales: 128), so a program's loads are 1 KiB runs instead of
64-byte pieces of rows K/2 bytes apart; the tile's values and their K order are the same, only the addresses
change.

Rows: masked layout → expert e, row m at a + e·stride_ae + m·stride_am, m < masked_m[e]; contiguous
layout → rows offsets[e] + m, m < counts[e], the tile → expert map computed in-kernel from counts
(no host sync; the grid is `max_blocks(N)` tiles, extra programs exit). A masked slab whose producer bounds its rows
(`max_rows`) runs as the same block list (expert e owns ⌈masked_m[e] / BLOCK_M⌉ blocks, the blocks of experts with
rows first, at most `max_blocks(max_rows)`), else as one program per (expert, slab block). Rows past the valid
ones are never read, never written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdlab.moe.triton.tiled import tiled_chunk, tiled_cols, tiled_rows

A_FLOAT, A_FP8, A_NVFP4 = 0, 1, 2


@triton.jit
def _e4m3_to_f32(s):
    x = s.to(tl.int32)
    bits = ((x & 0x7F) << 7) | ((x & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _nibbles_f16(b):
    """uint8 bytes → (low nibble, high nibble) as fp16 value·2^-14 by shifts: s<<15 | e1 e0 m<<9 (exact, subnormals
    too)."""
    x = b.to(tl.int32)
    lo = (((x << 28) >> 19) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((x << 24) >> 19) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _dequant_nvfp4(b, sf, R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr, I16: tl.constexpr = False):
    """b uint8 [R, C/2] (low nibble = even element), sf uint8 e4m3 bits [R, C/16] → OUT [R, C] = value·2^-14.

    I16: unpack in 16-bit integers (no int32 → int16 truncation per element)."""
    if I16:
        x = b.to(tl.int16)
        s3 = tl.full([], 3, tl.int16)
        m = tl.full([], -29184, tl.int16)  # 0x8E00: sign bit + the 3 code bits at 9..11
        lo = (((x << tl.full([], 12, tl.int16)) >> s3) & m)
        hi = (((x << tl.full([], 8, tl.int16)) >> s3) & m)
        tl.static_assert(lo.dtype == tl.int16)
        lo = lo.to(tl.float16, bitcast=True)
        hi = hi.to(tl.float16, bitcast=True)
    else:
        lo, hi = _nibbles_f16(b)
    v = tl.reshape(tl.join(lo, hi), (R, C))
    s = _e4m3_to_f32(sf).to(tl.float16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 16)), (R, C))
    return (v * s).to(OUT)


@triton.jit
def _dequant_nvfp4_split(b, sf, R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr):
    """b uint8 [R, C/2], sf uint8 [R, C/16] → (even, odd) OUT [R, C/2] each = value·2^-14, no interleave."""
    lo, hi = _nibbles_f16(b)
    s = _e4m3_to_f32(sf).to(tl.float16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 8)), (R, C // 2))
    return (lo * s).to(OUT), (hi * s).to(OUT)


# e2m1 nibble (s e1 e0 m) → e4m3 byte s<<7 | (e1 e0 m)<<2 = value · 2^-6 exactly (subnormals too), then the
# hardware e4m3x2 → f16x2 conversion (sm89+) and the block scale in f16x2: ~2 instructions per element.
# Outputs: $0 = low nibbles of bytes 0, 1; $1 = of bytes 2, 3; $2, $3 = the high nibbles; SCALE01 multiplies
# $0 and $2, SCALE23 $1 and $3 (`deq_ptx`).
_DEQ_PTX = """
{
.reg .b32 t, u, lo, hi;
.reg .b16 l0, l1, h0, h1;
shl.b32 t, $4, 2;
shl.b32 u, $4, 4;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, u, 0x80808080;
or.b32 lo, t, u;
shr.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $4, 0x80808080;
or.b32 hi, t, u;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
mul.rn.f16x2 $0, $0, SCALE01;
mul.rn.f16x2 $1, $1, SCALE23;
mul.rn.f16x2 $2, $2, SCALE01;
mul.rn.f16x2 $3, $3, SCALE23;
}
"""


def deq_ptx(scale01: str, scale23: str) -> str:
    """The DEQ_ASM=1 unpack of the 8 nibbles in $4 with the given scale operands (e.g. "$5", "$6")."""
    return _DEQ_PTX.replace("SCALE01", scale01).replace("SCALE23", scale23)


_DEQ_ASM = tl.constexpr(deq_ptx("$5", "$6"))


# DEQ_ASM=2: no conversion instruction. A nibble's fp16 bits value·2^-14 (s<<15 | e1 e0 m<<9, exact for
# subnormals too, as the integer unpack) have a zero low byte, so each nibble becomes the high byte
# s<<7 | (e1 e0 m)<<1 by shifts and masks, and byte permutes (prmt, integer pipe) spread two such bytes
# into an f16x2 with zero low bytes; then the block scale in f16x2. Same bits as the integer unpack
# (value·2^-14·scale, one fp16 rounding), without `cvt.f16x2.e4m3x2`, whose pipe issues fewer per clock.
_DEQ_ASM_PRMT = tl.constexpr("""
{
.reg .b32 t, u, lo, hi, z;
mov.b32 z, 0;
shl.b32 t, $4, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $4, 4;
and.b32 u, u, 0x80808080;
or.b32 lo, t, u;
shr.b32 t, $4, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $4, 0x80808080;
or.b32 hi, t, u;
prmt.b32 $0, lo, z, 0x1404;
prmt.b32 $1, lo, z, 0x3424;
prmt.b32 $2, hi, z, 0x1404;
prmt.b32 $3, hi, z, 0x3424;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}
""")


@triton.jit
def _deq_asm(b, s, ASM: tl.constexpr):
    """The PTX unpack of packed nibbles b with fp16 scales s (one per element pair): (even, odd) fp16."""
    if ASM == 2:
        return tl.inline_asm_elementwise(_DEQ_ASM_PRMT, "=r,=r,=r,=r,r,r,r", [b, s],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return tl.inline_asm_elementwise(_DEQ_ASM, "=r,=r,=r,=r,r,r,r", [b, s],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _dequant_nvfp4_asm(b, sf, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr = 1):
    """b uint8 [R, C/2], sf uint8 e4m3 [R, C/16] → (even, odd) fp16 [R, C/2] = value·scale·2^-6 (ASM 1, exact)
    or value·scale·2^-14 (ASM 2, the integer unpack's bits).

    PTX (ASM 1: cvt e4m3x2, sm89+; ASM 2: prmt): not for the interpreter."""
    s = _e4m3_to_f32(sf).to(tl.float16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 8)), (R, C // 2))
    return _deq_asm(b, s, ASM)


@triton.jit
def _perm_bytes(x, R: tl.constexpr, C: tl.constexpr):
    """[R, C/2] in byte order → PERM_K order: within each 16-byte group, logical byte 4i + t is physical
    byte 4t + i, so that one MMA-fragment thread's bytes are 4 contiguous ones (32-bit shared loads)."""
    x = tl.permute(tl.reshape(x, (R, C // 32, 4, 4)), (0, 1, 3, 2))
    return tl.reshape(x, (R, C // 2))


@triton.jit
def _perm_k(x, R: tl.constexpr, C: tl.constexpr):
    """Activations [R, C] in K order → the K order of _perm_bytes (element 2·byte + nibble)."""
    x = tl.permute(tl.reshape(x, (R, C // 32, 4, 4, 2)), (0, 1, 3, 2, 4))
    return tl.reshape(x, (R, C))


@triton.jit
def _unpack_scaled(b, s, ASM: tl.constexpr):
    """Packed bytes b [R, W] uint8 with fp16 scales s [R, W] → (low nibbles, high nibbles) fp16 [R, W], scaled: the
    PTX unpack (ASM 1: value·scale·2^-6, ASM 2: value·scale·2^-14) or the integer one (value·scale·2^-14)."""
    if ASM:
        return _deq_asm(b, s, ASM)
    even, odd = _nibbles_f16(b)
    return even * s, odd * s


@triton.jit
def _dequant_w(b, sf, R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr, I16: tl.constexpr, ASM: tl.constexpr,
               PERM: tl.constexpr):
    """Weight tile [R, C] = value·scale·2^-6 (ASM 1) or ·2^-14 (ASM 2, integer unpack), K in natural or PERM_K
    order."""
    if ASM or PERM:
        s = _e4m3_to_f32(sf).to(tl.float16)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // 16, 8)), (R, C // 2))
        if PERM:
            b = _perm_bytes(b, R, C)
            s = _perm_bytes(s, R, C)
        even, odd = _unpack_scaled(b, s, ASM)
        return tl.reshape(tl.join(even, odd), (R, C)).to(OUT)
    else:
        return _dequant_nvfp4(b, sf, R, C, OUT, I16)


@triton.jit
def _split_perm_index(W: tl.constexpr):
    """[W] physical byte of each logical byte in SPLIT_NIBBLES + PERM_K order: within each 16, logical 8h + 2q + u
    is byte 4q + 2h + u, so that one MMA-fragment thread's bytes (the K pairs 2q, 2q+1 and 2q+8, 2q+9 of each 16
    of a half-K dot) are 4 contiguous bytes."""
    j = tl.arange(0, W)
    return (j // 16) * 16 + ((j % 8) // 2) * 4 + ((j % 16) // 8) * 2 + j % 2


@triton.jit
def _dequant_nvfp4_bytes(b, sf, OUT: tl.constexpr):
    """b uint8 [R, W], sf uint8 e4m3 [R, W] (each byte's own block scale) → (even, odd) OUT [R, W] = value·2^-14."""
    lo, hi = _nibbles_f16(b)
    s = _e4m3_to_f32(sf).to(tl.float16)
    return (lo * s).to(OUT), (hi * s).to(OUT)


@triton.jit
def _dequant_w_split(b, sf, R: tl.constexpr, C: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr,
                     PERM: tl.constexpr = False):
    """b uint8 [R, C/2], sf uint8 e4m3 [R, C/16] → (even, odd) OUT [R, C/2] (SPLIT_NIBBLES). PERM: the bytes are taken
    in `_split_perm_index`'s order (an in-register permute of the tile) and the scales follow it: logical byte j
    of each 16 has the 16's block (j % 8) // 4."""
    if PERM:
        s = _e4m3_to_f32(sf).to(tl.float16)
        s = tl.reshape(s, (R, C // 32, 2))
        s = tl.reshape(tl.broadcast_to(s[:, :, None, :, None], (R, C // 32, 2, 2, 4)), (R, C // 2))
        b = tl.reshape(tl.permute(tl.reshape(b, (R, C // 32, 4, 2, 2)), (0, 1, 3, 2, 4)), (R, C // 2))
        even, odd = _unpack_scaled(b, s, ASM)
        return even.to(OUT), odd.to(OUT)
    if ASM:
        even, odd = _dequant_nvfp4_asm(b, sf, R, C, ASM)
        return even.to(OUT), odd.to(OUT)
    else:
        return _dequant_nvfp4_split(b, sf, R, C, OUT)


@triton.jit
def _load_a_half(a_rows, a_sf_ptr, sf_rows, m_mask, kk, A_KIND: tl.constexpr, MMA: tl.constexpr,
                 A_DOWN: tl.constexpr):
    """Activations at columns kk ([BLOCK_K/2] even or odd indices) → MMA [BLOCK_M, BLOCK_K/2]."""
    if A_KIND == 0:
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        if A_DOWN:
            a = (a.to(tl.float32) * 0.00390625).to(MMA)
        else:
            a = a.to(MMA)
    else:
        ab = tl.load(a_rows + kk[None, :], mask=m_mask[:, None], other=0)
        asf = tl.load(sf_rows + (kk // 128)[None, :], mask=m_mask[:, None], other=0.0)
        if A_DOWN:
            asf = asf * 0.00390625
        a = (_e4m3_to_f32(ab) * asf).to(MMA)
    return a


@triton.jit
def listed_block(cnt_ptr, blk, NUM_E, BM: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, row count) of token block blk of the block list in which expert e owns ⌈cnt[e] / BM⌉
    blocks, experts in order (NUM_E of them, E_POW2 ≥ NUM_E a power of two), computed from the counts; past the last
    block the expert is NUM_E - 1 and the count 0. (The Gluon GEMMs of nvfp4_frag.py have their own copy,
    `_listed_block`: a Gluon kernel cannot call a Triton function.)"""
    ei = tl.arange(0, E_POW2)
    cnt = tl.load(cnt_ptr + ei, mask=ei < NUM_E, other=0)
    nb = (cnt + (BM - 1)) // BM
    ends = tl.cumsum(nb, 0)  # past NUM_E: the total, never ≤ blk while blk is a block
    found = tl.sum((ends <= blk).to(tl.int32), 0)  # experts whose blocks all come before blk
    mine = ei == found
    start = tl.sum(tl.where(mine, ends - nb, 0), 0)
    count = tl.sum(tl.where(mine, cnt, 0), 0)  # 0 past the last block (found ≥ NUM_E)
    return tl.minimum(found, NUM_E - 1), (blk - start) * BM, count


def max_blocks(rows: int, experts: int, block_m: int) -> int:
    """An upper bound of the token blocks of `rows` contiguous rows over `experts` experts (Σ ⌈counts[e] / block_m⌉,
    whatever the counts): ⌈rows / block_m⌉ + min(experts, rows), since only experts with rows add a partial block
    and there are at most `rows` of them. The contiguous grid's size (programs past the last block exit at once):
    1 token routed to 8 of 256 experts launches 9 token blocks per N tile instead of 257."""
    return -(-rows // block_m) + min(experts, rows)


def slab_blocks(experts: int, rows: int, block_m: int, cap: int | None = None) -> int:
    """The token blocks a slab of `experts` × `rows` runs as a block list: E·⌈rows / block_m⌉, at most `cap`
    (`max_blocks` of the layout's max_rows; None: no cap). What the GEMMs and the activation kernel launch."""
    n = experts * -(-rows // block_m)
    return n if cap is None else min(n, cap)


# num_m_tiles follows the token count: not specialised (== 1, % 16), or a new count class would compile anew
@triton.jit(do_not_specialize=["num_m_tiles"])
def _moe_nvfp4_gemm(
    a_ptr, a_sf_ptr, a_gs_ptr, w_ptr, w_sf_ptr, w_s2_ptr, out_ptr, cnt_ptr, off_ptr,
    N, K, up_offset, M_MAX, num_m_tiles, num_n_tiles,
    stride_ae, stride_am, stride_asf_e, stride_asf_m,
    stride_we, stride_wn, stride_wsf_e, stride_wsf_n,
    stride_oe, stride_om,
    E: tl.constexpr, E_POW2: tl.constexpr, A_KIND: tl.constexpr, A_GS_PER_EXPERT: tl.constexpr,
    MASKED: tl.constexpr, FUSE_SILU: tl.constexpr, MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_NIBBLES: tl.constexpr, A_DOWN: tl.constexpr, UNPACK16: tl.constexpr,
    DEQ_ASM: tl.constexpr = 0, PERM_K: tl.constexpr = False, TILED: tl.constexpr = False,
    LIST: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    in_group = GROUP_M * num_n_tiles
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    if MASKED:
        if LIST:  # the slab's token blocks as a block list: the blocks of experts with rows first
            e, m0, count = listed_block(cnt_ptr, pid_m, E, BLOCK_M, E_POW2)
        else:  # one program per (expert, slab block)
            tiles_per_expert = tl.cdiv(M_MAX, BLOCK_M)
            e = pid_m // tiles_per_expert
            m0 = (pid_m % tiles_per_expert) * BLOCK_M
            count = tl.load(cnt_ptr + e)
        row_base = 0
    else:
        e, m0, count = listed_block(cnt_ptr, pid_m, E, BLOCK_M, E_POW2)
        row_base = tl.load(off_ptr + e)
    if m0 < count:
        e64 = e.to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = (row_base + offs_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N

        k_len = K // SPLIT_K
        k_begin = pid_k * k_len
        a_rows = a_ptr + e64 * stride_ae + rows[:, None] * stride_am
        if TILED:  # tile_nvfp4 layout: rows in groups of 16, K in chunks of 128 (module docstring)
            w_off, sf_off = tiled_rows(offs_n.to(tl.int64), K // 2)
            w_rows = w_ptr + e64 * stride_we + w_off[:, None]
            wsf_rows = w_sf_ptr + e64 * stride_wsf_e + sf_off[:, None]
            # up_offset is a whole number of row groups: its row start is a multiple of one group's bytes
            up_w, up_sf = tiled_rows((up_offset // 16).to(tl.int64) * 16, K // 2)
        else:
            w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            wsf_rows = w_sf_ptr + e64 * stride_wsf_e + offs_n[:, None].to(tl.int64) * stride_wsf_n
            up_w = up_offset.to(tl.int64) * stride_wn
            up_sf = up_offset.to(tl.int64) * stride_wsf_n
        if FUSE_SILU:
            wu_rows = w_rows + up_w
            wusf_rows = wsf_rows + up_sf
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_begin, k_begin + k_len, BLOCK_K):
            # k is a multiple of BLOCK_K (the launcher checks K % (BLOCK_K·SPLIT_K) == 0): telling Triton so
            # makes the weight rows 16-byte vector copies instead of 8-byte ones
            kh = tl.max_contiguous(tl.multiple_of(k // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2), BLOCK_K // 2)
            ks = k // 16 + tl.arange(0, BLOCK_K // 16)
            if PERM_K:  # BLOCK_K-aligned tiles: vector (cp.async) loads of the scale rows too
                ks = tl.max_contiguous(tl.multiple_of(ks, BLOCK_K // 16), BLOCK_K // 16)
            if TILED:  # this K block's bytes in the row: 64-byte (weights) / 8-byte (scales) runs, 1 KiB apart
                jb, js = tiled_cols(tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 16))
                w0, s0 = tiled_chunk(k // 128)  # k is a multiple of 128: the block starts a chunk
                wkh = tl.max_contiguous(tl.multiple_of(jb + w0, 64), 64)
                wks = tl.max_contiguous(tl.multiple_of(js + s0, 8), 8)
            else:
                wkh = kh
                wks = ks
            if SPLIT_NIBBLES:
                # K permuted: even columns (low nibbles) then odd ones, two dots, no interleave; with PERM_K the
                # bytes of each 16 in _split_perm's order (the weights' in-register permute, the activations'
                # load addresses)
                kp = kh
                if PERM_K:
                    kp = k // 2 + _split_perm_index(BLOCK_K // 2)
                if A_KIND == 2:
                    ab = tl.load(a_rows + kp[None, :], mask=m_mask[:, None], other=0)
                    if PERM_K:  # a block scale per byte (byte kp has block kp // 8)
                        asf = tl.load(a_sf_ptr + e64 * stride_asf_e + rows[:, None] * stride_asf_m + (kp // 8)[None, :],
                                      mask=m_mask[:, None], other=0)
                        a_even, a_odd = _dequant_nvfp4_bytes(ab, asf, MMA)
                    else:
                        asf = tl.load(a_sf_ptr + e64 * stride_asf_e + rows[:, None] * stride_asf_m + ks[None, :],
                                      mask=m_mask[:, None], other=0)
                        a_even, a_odd = _dequant_nvfp4_split(ab, asf, BLOCK_M, BLOCK_K, MMA)
                else:
                    sf_rows = a_sf_ptr + e64 * stride_asf_e + rows[:, None] * stride_asf_m
                    a_even = _load_a_half(a_rows, a_sf_ptr, sf_rows, m_mask, 2 * kp, A_KIND, MMA, A_DOWN)
                    a_odd = _load_a_half(a_rows, a_sf_ptr, sf_rows, m_mask, 2 * kp + 1, A_KIND, MMA, A_DOWN)
                at_even = tl.trans(a_even)
                at_odd = tl.trans(a_odd)
                wb = tl.load(w_rows + wkh[None, :], mask=n_mask[:, None], other=0)
                wsf = tl.load(wsf_rows + wks[None, :], mask=n_mask[:, None], other=0)
                w_even, w_odd = _dequant_w_split(wb, wsf, BLOCK_N, BLOCK_K, MMA, DEQ_ASM, PERM_K)
                acc = tl.dot(w_even, at_even, acc)
                acc = tl.dot(w_odd, at_odd, acc)
                if FUSE_SILU:
                    wub = tl.load(wu_rows + wkh[None, :], mask=n_mask[:, None], other=0)
                    wusf = tl.load(wusf_rows + wks[None, :], mask=n_mask[:, None], other=0)
                    wu_even, wu_odd = _dequant_w_split(wub, wusf, BLOCK_N, BLOCK_K, MMA, DEQ_ASM, PERM_K)
                    acc_u = tl.dot(wu_even, at_even, acc_u)
                    acc_u = tl.dot(wu_odd, at_odd, acc_u)
            else:
                # activations [BLOCK_M, BLOCK_K]
                if A_KIND == 0:
                    a = tl.load(a_rows + (k + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
                    if A_DOWN:
                        a = (a.to(tl.float32) * 0.00390625).to(MMA)
                    else:
                        a = a.to(MMA)
                elif A_KIND == 1:
                    kk = k + tl.arange(0, BLOCK_K)
                    ab = tl.load(a_rows + kk[None, :], mask=m_mask[:, None], other=0)
                    asf = tl.load(a_sf_ptr + e64 * stride_asf_e + rows[:, None] * stride_asf_m + (kk // 128)[None, :],
                                  mask=m_mask[:, None], other=0.0)
                    if A_DOWN:
                        asf = asf * 0.00390625
                    a = (_e4m3_to_f32(ab) * asf).to(MMA)
                else:
                    ab = tl.load(a_rows + kh[None, :], mask=m_mask[:, None], other=0)
                    asf = tl.load(a_sf_ptr + e64 * stride_asf_e + rows[:, None] * stride_asf_m + ks[None, :],
                                  mask=m_mask[:, None], other=0)
                    a = _dequant_nvfp4(ab, asf, BLOCK_M, BLOCK_K, MMA, UNPACK16)
                if PERM_K:
                    a = _perm_k(a, BLOCK_M, BLOCK_K)
                at = tl.trans(a)
                wb = tl.load(w_rows + wkh[None, :], mask=n_mask[:, None], other=0)
                wsf = tl.load(wsf_rows + wks[None, :], mask=n_mask[:, None], other=0)
                acc = tl.dot(_dequant_w(wb, wsf, BLOCK_N, BLOCK_K, MMA, UNPACK16, DEQ_ASM, PERM_K), at, acc)
                if FUSE_SILU:
                    wub = tl.load(wu_rows + wkh[None, :], mask=n_mask[:, None], other=0)
                    wusf = tl.load(wusf_rows + wks[None, :], mask=n_mask[:, None], other=0)
                    acc_u = tl.dot(_dequant_w(wub, wusf, BLOCK_N, BLOCK_K, MMA, UNPACK16, DEQ_ASM, PERM_K), at, acc_u)

        alpha = tl.load(w_s2_ptr + e) * (64.0 if DEQ_ASM == 1 else 16384.0)
        if A_DOWN:
            alpha = alpha * 256.0
        if A_KIND == 2:
            if A_GS_PER_EXPERT:
                alpha = alpha * (16384.0 / tl.load(a_gs_ptr + e))
            else:
                alpha = alpha * (16384.0 / tl.load(a_gs_ptr))
        res = acc * alpha
        if FUSE_SILU:
            res = res / (1.0 + tl.exp(-res)) * (acc_u * alpha)
        o_ptrs = out_ptr + e64 * stride_oe + rows[None, :] * stride_om + offs_n[:, None]
        o_mask = n_mask[:, None] & m_mask[None, :]
        if SPLIT_K > 1:
            tl.atomic_add(o_ptrs, res, mask=o_mask)
        else:
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)


_MMA = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def moe_nvfp4_gemm(a: torch.Tensor, a_kind: int, a_sf: torch.Tensor | None, a_gs: torch.Tensor | None,
                   w: torch.Tensor, w_sf: torch.Tensor, w_s2: torch.Tensor, out: torch.Tensor,
                   counts: torch.Tensor, offsets: torch.Tensor | None, *, masked: bool, n: int, k: int,
                   fuse_silu: bool, mma_dtype: torch.dtype, cfg: dict, max_rows: int | None = None) -> torch.Tensor:
    """out[rows, :n] = act(A[rows] @ W[e][:n]ᵀ) per expert (see module docstring).

    a: masked [E, M, K] / contiguous [R, K] float, or fp8 bytes (a_sf fp32 [.., K/128]), or nvfp4 bytes
    [.., K/2] (a_sf uint8 [.., K/16], a_gs fp32 [1] or [E]). w: [E, N_total, K/2] uint8, w_sf uint8
    [E, N_total, K/16], w_s2 fp32 [E]. out: [E, M, n] or [R, n] (zeroed fp32 when SPLIT_K > 1).
    counts: [E] int32 (masked_m or counts); offsets: [E+1] int32 (contiguous only).
    max_rows (masked only): an upper bound of sum(masked_m) (`Masked.max_rows`); given, the slab runs as the block
    list of its experts' token blocks, at most `max_blocks(max_rows)` of them (rows past the bound are not
    computed); None: one program per (expert, slab block).
    cfg: block sizes, warps, stages and the knobs of moe/runners/triton_nvfp4.py (DEQ_ASM needs an fp16
    MMA and runs the integer unpack under TRITON_INTERPRET=1; PERM_K is ignored for fp8 activations).
    Graph-safe (no host sync)."""
    E = w.shape[0]
    # fp16 MMA for non-fp16 float / fp8 activations: scale them by 2^-8 on load (alpha ·256) so that
    # values up to 1.6e7 fit fp16; the weights are exact in fp16 either way.
    a_down = bool(mma_dtype == torch.float16 and a_kind != A_NVFP4 and a.dtype != torch.float16)
    # the PTX unpack needs a real GPU (sm89+) and an fp16 MMA; the interpreter runs the integer unpack
    deq_asm = int(cfg.get("DEQ_ASM", 0) or 0) if (mma_dtype == torch.float16
                                                 and os.environ.get("TRITON_INTERPRET") != "1") else 0
    # NOTE: triton 3.6 fails to compile the permuted fp8-activation tile (TritonGPUOptimizeDotOperands)
    perm_k = bool(cfg.get("PERM_K", 0)) and a_kind != A_FP8
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiled = bool(cfg.get("TILED", 0))
    split_k = cfg.get("SPLIT_K", 1) if not fuse_silu else 1
    while bk > 32 and k % (bk * split_k):
        bk //= 2
    if k % (bk * split_k):
        split_k = 1
    if k % bk:
        raise ValueError(f"moe_nvfp4_gemm: K={k} must be a multiple of 32")
    if tiled and (bk % 128 or bn % 16 or n % 16):
        raise ValueError(f"moe_nvfp4_gemm: tiled weights need BLOCK_K % 128 == 0 and BLOCK_N, N multiples of 16 "
                         f"(got BLOCK_K={bk}, BLOCK_N={bn}, N={n}, K={k}); use the plain layout (TILED=0)")
    listed = masked and max_rows is not None
    if masked:
        m_max = a.shape[1]
        num_m = slab_blocks(E, m_max, bm, max_blocks(max_rows, E, bm) if listed else None)
        stride_ae, stride_am = a.stride(0), a.stride(1)
        stride_oe, stride_om = out.stride(0), out.stride(1)
        sf_e, sf_m = (a_sf.stride(0), a_sf.stride(1)) if a_sf is not None else (0, 0)
    else:
        m_max = 0
        num_m = max_blocks(a.shape[0], E, bm)
        stride_ae, stride_am = 0, a.stride(0)
        stride_oe, stride_om = 0, out.stride(0)
        sf_e, sf_m = (0, a_sf.stride(0)) if a_sf is not None else (0, 0)
    num_n = triton.cdiv(n, bn)
    if num_m == 0 or num_n == 0:
        return out
    grid = (num_m * num_n, split_k)
    _moe_nvfp4_gemm[grid](
        a, a_sf if a_sf is not None else a, a_gs if a_gs is not None else w_s2, w, w_sf, w_s2, out, counts,
        offsets if offsets is not None else counts,
        n, k, n if fuse_silu else 0, m_max, num_m, num_n,
        stride_ae, stride_am, sf_e, sf_m,
        w.stride(0), w.stride(1), w_sf.stride(0), w_sf.stride(1),
        stride_oe, stride_om,
        E=E, E_POW2=triton.next_power_of_2(E), A_KIND=a_kind,
        A_GS_PER_EXPERT=a_gs is not None and a_gs.numel() > 1,
        MASKED=masked, FUSE_SILU=fuse_silu, MMA=_MMA[mma_dtype],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8), SPLIT_K=split_k,
        SPLIT_NIBBLES=bool(cfg.get("SPLIT_NIBBLES", 0)), A_DOWN=a_down,
        UNPACK16=bool(cfg.get("UNPACK16", 0)), DEQ_ASM=deq_asm, PERM_K=perm_k, TILED=tiled, LIST=listed,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
