"""Triton NVFP4 quantize kernel (imported only when the `triton` backend runs; imports triton).

One program quantizes BLOCK_M rows x BLOCK_K columns of one group (grid axis 2: the expert of a
grouped [E, M, K] input, else 0). The input is read as words holding an (even, odd) element pair,
so unpacking is a shift and packing two codes into a byte needs no shuffle; each 16-element block is
loaded as two 16-byte halves, so one thread owns whole blocks: the block maximum and the per-block
scale arithmetic stay in registers and are done once per block.

The arithmetic is the reference's, step for step (pdlab.kernels.nvfp4): fp32, IEEE round-to-nearest
division (`div_rn`, not the approximate `/`), and the e4m3 and e2m1 roundings done by fp32 additions
of "magic" constants plus bit arithmetic (no fp8 casts), so the kernel is exact on GPU and under the
CPU interpreter alike (whose fp8 casts differ from torch's). A block holding a NaN gets the NaN scale byte 0x7F
and sign-only codes, as the reference (its NaN is not hidden as a finite value).
"""

import triton
import triton.language as tl


@triton.jit
def _e4m3_rne(v):
    """fp32 v in [0, 448] (no NaN) -> (value of e4m3(v) as fp32, its e4m3 byte in the low 8 bits
    of an int32), RNE.

    One fp32 addition of C rounds v to a multiple of C's ulp 2^(e - 3), the e4m3 step at v's
    exponent e (e >= -6; below, the subnormal step 2^-9): C = 2^(e + 20) plus (e + 6) * 8 ulps, so
    the sum's low bits are (e + 6) * 8 + (steps of v), which is the e4m3 byte (continuous across
    binades and into the subnormals), and s - C is the rounded value, exactly."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    c = (e * ((1 << 23) + 8) + ((147 << 23) + 48)).to(tl.float32, bitcast=True)
    s = v + c
    return s - c, s.to(tl.int32, bitcast=True)


@triton.jit
def _e2m1_magic(y):
    """fp32 y -> fp32 bits whose low 3 bits are the E2M1 code of |y| (RNE, saturating at 6).

    |y| is rounded by one fp32 addition of C, whose ulp is the E2M1 step of |y|'s range (0.5
    below 2, 1 below 4, 2 up to 6): C = 2^(22 + j) plus 2j ulps for range j, so the sum's low bits
    are 2j + (steps of |y|), which is the code."""
    a = tl.minimum(tl.abs(y), 6.0)
    k = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127)  # exponent field: 127, 128 or 129 (a <= 6)
    s = a + (k * ((1 << 23) + 2) + ((22 << 23) - 254)).to(tl.float32, bitcast=True)
    return s.to(tl.uint32, bitcast=True)


@triton.jit
def _e2m1_rne(y):
    """fp32 y (no NaN) -> E2M1 code (int32 in [0, 15]): RNE, saturating at 6, sign bit kept."""
    return (_e2m1_magic(y) & 7).to(tl.int32) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _unpack_pairs(w, IN_KIND: tl.constexpr):
    """Words holding two consecutive elements -> (even, odd) as fp32. IN_KIND 0: bf16 pairs in
    int32, 1: fp16 pairs in int32, 2: fp32 pairs in int64 (low half = even element)."""
    if IN_KIND == 0:
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        even = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        even = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        odd = ((w >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _block_amax_bits(e, o):
    """max |x| of each block as the int32 bits of a non-negative fp32: integer order is float order there, and a
    NaN (bits above 0x7F800000) wins, where a float max would drop it (GPU max/min return the non-NaN operand)."""
    return tl.max(tl.maximum(tl.abs(e).to(tl.int32, bitcast=True), tl.abs(o).to(tl.int32, bitcast=True)), axis=2)


@triton.jit
def _quant_pairs(w, even, odd, mult, IN_KIND: tl.constexpr):
    """Two E2M1 codes per byte, the even element in the low nibble. The sign bits are the input's
    (mult >= 0): for 16-bit pairs one high multiply moves bits 15 and 31 of the word to 3 and 7."""
    ye = even * mult
    yo = odd * mult
    byte = _e2m1_magic(ye) + (_e2m1_magic(yo) << 4)  # codes in the low 3 bits of each: lo + 16 * hi
    if IN_KIND == 2:
        signs = ((ye.to(tl.uint32, bitcast=True) >> 28) & 8) | ((yo.to(tl.uint32, bitcast=True) >> 24) & 0x80)
    else:
        signs = tl.umulhi(w.to(tl.uint32, bitcast=True) & 0x80008000, 0x00100100) & 0x88
    return (byte | signs).to(tl.uint8)  # the high bits of the sums fall away here


@triton.jit
def e4m3_e2m1_probe_kernel(v_ptr, sf_val_ptr, sf_byte_ptr, code_ptr, pair_ptr, N, BLOCK: tl.constexpr):
    """Test hook: the kernel's own roundings applied to N fp32 values (N even): e4m3 of |v|, the
    E2M1 code of v, and the packed byte of each (even, odd) pair as the quantize kernel packs it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    val, byte = _e4m3_rne(tl.minimum(tl.abs(v), 448.0))
    tl.store(sf_val_ptr + offs, val, mask=mask)
    tl.store(sf_byte_ptr + offs, byte.to(tl.uint8), mask=mask)
    tl.store(code_ptr + offs, _e2m1_rne(v).to(tl.uint8), mask=mask)
    half = tl.program_id(0) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    pmask = half < N // 2
    even = tl.load(v_ptr + 2 * half, mask=pmask, other=0.0)
    odd = tl.load(v_ptr + 2 * half + 1, mask=pmask, other=0.0)
    w16 = (even.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
        odd.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16)  # signs only (16-bit path)
    one = tl.full((BLOCK // 2,), 1.0, tl.float32)
    tl.store(pair_ptr + half, _quant_pairs(w16, even, odd, one, 0), mask=pmask)
    tl.store(pair_ptr + N // 2 + half, _quant_pairs(w16, even, odd, one, 2), mask=pmask)


@triton.jit(do_not_specialize=["M"])  # rows follow the token count: no recompile per count class
def nvfp4_quant_kernel(
    x_ptr, gs_ptr, mm_ptr, q_ptr, sf_ptr,
    M, K, stride_xw, sw_k_tiles,
    IN_KIND: tl.constexpr, GS_MODE: tl.constexpr, HAS_MASK: tl.constexpr, SWIZZLE: tl.constexpr,
    OFFS_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILES_K: tl.constexpr,
):
    """x: rows g*M + m of a [G*M, K] view, read as words of two elements (row stride stride_xw
    words; IN_KIND 0 bf16 / 1 fp16 in int32 words, 2 fp32 in int64 words). GS_MODE: 0 one global
    scale, 1 one per group, 2 one per row. HAS_MASK: rows m >= masked_m[g] are not read (zero output).
    SWIZZLE: scales go to the 128x4 layout [G, ceil(M/128), sw_k_tiles, 32, 4, 4]. OFFS_64: offsets
    need 64 bits (inputs or outputs of 2^31 elements or more). TILES_K: K-tiles of BLOCK_K done by
    one program, in a loop (which num_stages can software-pipeline); 1 = no loop."""
    NB: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the group
    in_rows = m < M
    live = in_rows
    if HAS_MASK:
        live = in_rows & (m < tl.load(mm_ptr + g))
    zero = tl.zeros((BLOCK_M, NB), tl.float32)
    if GS_MODE == 2:
        gs = zero + tl.load(gs_ptr + m, mask=in_rows, other=1.0)[:, None]
    elif GS_MODE == 1:
        gs = zero + tl.load(gs_ptr + g)
    else:
        gs = zero + tl.load(gs_ptr)
    if OFFS_64:
        row = g.to(tl.int64) * M + m
    else:
        row = g * M + m
    if TILES_K == 1:
        w_lo, w_hi = _load_tile(x_ptr, K, stride_xw, row, live, pid_k, True, NB)
        _quant_tile(w_lo, w_hi, q_ptr, sf_ptr, M, K, sw_k_tiles, g, m, row, in_rows, gs, zero,
                    pid_k, IN_KIND, SWIZZLE, NB)
    else:
        # the next tile's loads are issued before this tile's arithmetic (register double buffering)
        w_lo, w_hi = _load_tile(x_ptr, K, stride_xw, row, live, pid_k * TILES_K, True, NB)
        for t in range(TILES_K):
            tile = pid_k * TILES_K + t
            n_lo, n_hi = _load_tile(x_ptr, K, stride_xw, row, live, tile + 1, t + 1 < TILES_K, NB)
            _quant_tile(w_lo, w_hi, q_ptr, sf_ptr, M, K, sw_k_tiles, g, m, row, in_rows, gs, zero,
                        tile, IN_KIND, SWIZZLE, NB)
            w_lo = n_lo
            w_hi = n_hi


@triton.jit
def _load_tile(x_ptr, K, stride_xw, row, live, tile, valid, NB: tl.constexpr):
    """Words of K-tile `tile` for rows `row`: a block of 16 elements = 8 words of two elements,
    each half-block (4 words) one vector load. Returns ([BLOCK_M, NB, 4] x 2); zeros where masked."""
    blk = tile * NB + tl.arange(0, NB)
    offs = row[:, None, None] * stride_xw + blk[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    mask = (live[:, None, None] & (blk < K // 16)[None, :, None]) & valid
    return tl.load(x_ptr + offs, mask=mask, other=0), tl.load(x_ptr + offs + 4, mask=mask, other=0)


@triton.jit
def _quant_tile(w_lo, w_hi, q_ptr, sf_ptr, M, K, sw_k_tiles, g, m, row, in_rows, gs, zero, tile,
                IN_KIND: tl.constexpr, SWIZZLE: tl.constexpr, NB: tl.constexpr):
    """Quantize the loaded words of K-tile `tile` (rows `row`, m within group g) and store them."""
    blk = tile * NB + tl.arange(0, NB)  # 16-element block along K
    in_blk = blk < K // 16
    e_lo, o_lo = _unpack_pairs(w_lo, IN_KIND)
    e_hi, o_hi = _unpack_pairs(w_hi, IN_KIND)

    amax_bits = tl.maximum(_block_amax_bits(e_lo, o_lo), _block_amax_bits(e_hi, o_hi))  # [BLOCK_M, NB]
    nan_blk = amax_bits > 0x7F800000  # the block holds a NaN
    amax = tl.where(nan_blk, 0, amax_bits).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.math.div_rn(amax, zero + 6.0) * gs, 448.0)
    sf, sf_byte = _e4m3_rne(v)
    nonzero = sf > 0
    mult = tl.where(nonzero, tl.math.div_rn(gs, tl.where(nonzero, sf, 1.0)), 0.0)[:, :, None]
    # as the reference: a NaN block's scale is NaN (e4m3 0x7F) and its codes keep only the signs (x · 0)
    sf_byte = tl.where(nan_blk, 0x7F, sf_byte)
    keep = tl.where(nan_blk, 0x88, 0xFF).to(tl.uint8)[:, :, None]

    q_offs = row[:, None, None] * (K // 2) + blk[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    st_mask = in_rows[:, None, None] & in_blk[None, :, None]
    tl.store(q_ptr + q_offs, _quant_pairs(w_lo, e_lo, o_lo, mult, IN_KIND) & keep, mask=st_mask)
    tl.store(q_ptr + q_offs + 4, _quant_pairs(w_hi, e_hi, o_hi, mult, IN_KIND) & keep, mask=st_mask)

    sf_mask = in_rows[:, None] & in_blk[None, :]
    if SWIZZLE:
        mm = m[:, None]
        kk = blk[None, :]
        m_tiles = (M + 127) // 128
        sf_offs = (g.to(row.dtype) * (m_tiles * sw_k_tiles * 512) + (mm // 128) * (sw_k_tiles * 512)
                   + (kk // 4) * 512 + (mm % 32) * 16 + ((mm % 128) // 32) * 4 + (kk % 4))
    else:
        sf_offs = row[:, None] * (K // 16) + blk[None, :]
    tl.store(sf_ptr + sf_offs, sf_byte.to(tl.uint8), mask=sf_mask)
