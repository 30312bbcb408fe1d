"""Triton NVFP4 quantize kernel (imported only when the `triton` backend runs; imports triton).

One program quantizes a [BLOCK_M rows, BLOCK_K columns] tile, loaded with vectorised row loads
and viewed as [BLOCK_M, BLOCK_K/16, 16] for the block maxima; the element rounding takes about ten
instructions (no compare ladder) so the kernel stays memory-bound. The arithmetic is the reference's, step for step
(see pdlab.kernels.nvfp4): fp32, IEEE round-to-nearest division (`div_rn`, not the approximate
`/`), and the e4m3 cast done with integer arithmetic so the kernel is exact on GPU and under the
CPU interpreter alike.
"""

import triton
import triton.language as tl


@triton.jit
def _e4m3_rne(v):
    """fp32 v in [0, 448] (no NaN) -> (value of e4m3(v) as fp32, its e4m3 byte as int32), RNE."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    mant = (bits & 0x7FFFFF) | 0x800000
    # keep 3 mantissa bits for normals (e >= -6); subnormals have a fixed quantum of 2^-9
    shift = tl.minimum(tl.maximum(14 - e, 20), 30)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    e_eff = tl.maximum(e, -6)
    byte = (e_eff + 6) * 8 + q  # carries from q=15 to 16 land on the next exponent by construction
    pow2 = ((e_eff - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return q.to(tl.float32) * pow2, byte


@triton.jit
def _e2m1_rne(y):
    """fp32 y (no NaN) -> E2M1 code (int32 in [0, 15]): RNE, saturating at 6, sign bit kept.

    |y| is rounded by one fp32 addition of a power of two whose ulp is the E2M1 step of |y|'s
    range (0.5 below 2, 1 below 4, 2 up to 6); the sum's low bits then count steps."""
    a = tl.minimum(tl.abs(y), 6.0)
    k = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127), 129)  # exponent field: 127, 128, 129
    c_bits = (k + 22) << 23  # 2^22, 2^23, 2^24
    s = a + c_bits.to(tl.float32, bitcast=True)
    code = s.to(tl.int32, bitcast=True) - c_bits + 2 * (k - 127)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e4m3_e2m1_probe_kernel(v_ptr, sf_val_ptr, sf_byte_ptr, code_ptr, N, BLOCK: tl.constexpr):
    """Test hook: the kernel's own e4m3 and e2m1 roundings applied to N fp32 values."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    val, byte = _e4m3_rne(tl.minimum(tl.abs(v), 448.0))
    tl.store(sf_val_ptr + offs, val, mask=mask)
    tl.store(sf_byte_ptr + offs, byte.to(tl.uint8), mask=mask)
    tl.store(code_ptr + offs, _e2m1_rne(v).to(tl.uint8), mask=mask)


@triton.jit
def nvfp4_quant_kernel(
    x_ptr, gs_ptr, mm_ptr, q_ptr, sf_ptr,
    R, K, stride_xr, rows_per_group, gs_rows, gs_stride, sw_k_tiles, sw_group_elems,
    HAS_MASK: tl.constexpr, SWIZZLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = pid_k * NB + tl.arange(0, NB)
    in_rows = rows < R
    in_blocks = blocks < K // 16
    group = rows // rows_per_group
    live = in_rows
    if HAS_MASK:
        m_in_group = rows - group * rows_per_group
        count = tl.load(mm_ptr + group, mask=in_rows, other=0)
        live = in_rows & (m_in_group < count)
    gs = tl.load(gs_ptr + (rows // gs_rows) * gs_stride, mask=in_rows, other=1.0)

    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ld_mask = live[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=ld_mask, other=0.0)
    xb = tl.reshape(x.to(tl.float32), (BLOCK_M, NB, 16))

    amax = tl.max(tl.abs(xb), axis=2)  # [BLOCK_M, NB]
    gs2 = tl.broadcast_to(gs[:, None], (BLOCK_M, NB))
    six = tl.full((BLOCK_M, NB), 6.0, tl.float32)
    v = tl.minimum(tl.math.div_rn(amax, six) * gs2, 448.0)
    sf, sf_byte = _e4m3_rne(v)
    nonzero = sf > 0
    one = tl.full((BLOCK_M, NB), 1.0, tl.float32)
    mult = tl.where(nonzero, tl.math.div_rn(gs2, tl.where(nonzero, sf, one)), 0.0)

    y = xb * mult[:, :, None]
    code = _e2m1_rne(y)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
    packed = lo | (hi << 4)  # even element in the low nibble

    q_cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    st_mask = in_rows[:, None] & (q_cols < K // 2)[None, :]
    tl.store(q_ptr + rows[:, None].to(tl.int64) * (K // 2) + q_cols[None, :], packed.to(tl.uint8), mask=st_mask)

    sf_mask = in_rows[:, None] & in_blocks[None, :]
    if SWIZZLE:
        m = (rows - group * rows_per_group)[:, None]
        k = blocks[None, :]
        off = (group[:, None].to(tl.int64) * sw_group_elems + (m // 128) * (sw_k_tiles * 512)
               + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4))
    else:
        off = rows[:, None].to(tl.int64) * (K // 16) + blocks[None, :]
    tl.store(sf_ptr + off, sf_byte.to(tl.uint8), mask=sf_mask)
