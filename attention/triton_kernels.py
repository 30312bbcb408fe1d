"""pdlab's own Triton kernels for MLA over the paged latent cache.

`_mla_fwd`: one program = BLOCK_T query tokens × BLOCK_H heads of one sequence (M = BLOCK_T*BLOCK_H
rows: every head of a sequence shares the same latent rows, so one K tile feeds all M rows) against
one split of that sequence's KV range. Per BLOCK_N tile: page ids through the block table, q·k as
512 + 64 (`tl.dot` twice), online softmax in base 2, p·v over the first 512 columns of the same tile
(V is c_kv). fp8 pools are loaded as bytes, bitcast to e4m3 and upcast in registers; the scale folds
into the softmax scale and the output. Tokens at positions >= the split end are masked out of the
loads, so pages past a sequence's length are never read. With one split the program writes the
final output and lse; with several it writes fp32 partials that `_mla_combine` merges by lse.

With TOKEN_MAJOR the same kernel runs the computation token-major ("swap AB"): s^T = K·q^T [BLOCK_N, M] and
o^T += V^T·p^T [512, M], so the tile's tokens (and the 512 latent columns) fill the MMA's M side,
which on sm90 must be 64 per warpgroup for wgmma; q^T and p^T are the small N side. With few heads per
program (M = 16) this runs wgmma with K/V straight from the pipelined shared-memory tile instead of
mma.sync re-reading q from shared memory in every warp. fp8 pools: with FP8_RELOAD the V bytes are
loaded a second time (an L2 hit) so that V is upcast once in registers and stored to shared memory as
16-bit for the transposed operand, instead of gathering single bytes; K keeps its own pipelined copy.

D_QUARTERS (row-major): q, the tile and the accumulator in four column quarters of 128, each quarter loaded,
converted and multiplied on its own, so that a quarter of each is live at a time (fewer registers for an fp8
pool computed in fp16). PAGE_AHEAD (with one page per tile): each tile's page id is read one iteration
before the tile, which lets Triton's pipeliner keep num_stages - 1 tiles in flight instead of one.

Decode is the uniform case (S_q tokens per sequence, q_start = b*S_q); prefill/extend is ragged
(q_start from qo_indptr). Token j of a sequence with n new tokens sits at seqlen - n + j and sees
positions <= its own.

`_store_kv`: one program per latent row, scatter by slot, optional e4m3 quantization.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

LOG2E = 1.4426950408889634


@triton.jit
def _program_rows(SEQLENS, QO_INDPTR, H, num_splits, Q_PER_SEQ: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's M = BLOCK_T*BLOCK_H rows (query token j, head h, valid, causal limit) and its
    split [lo, hi) of the KV range."""
    hb = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = tl.program_id(2)
    qb = pid1 // num_splits
    split = pid1 % num_splits

    seqlen = tl.load(SEQLENS + b)
    if Q_PER_SEQ > 0:
        q_start = b * Q_PER_SEQ
        n_q = Q_PER_SEQ
    else:
        q_start = tl.load(QO_INDPTR + b)
        n_q = tl.load(QO_INDPTR + b + 1) - q_start
    prefix = seqlen - n_q
    j0 = qb * BLOCK_T

    M: tl.constexpr = BLOCK_T * BLOCK_H
    r = tl.arange(0, M)
    j = j0 + r // BLOCK_H
    h = hb * BLOCK_H + r % BLOCK_H
    row_ok = (j < n_q) & (h < H)
    limit = prefix + j + 1  # this row sees positions < limit

    # the KV range this q-block needs, cut into num_splits BLOCK_N-aligned pieces
    kv_hi = tl.where(j0 < n_q, prefix + tl.minimum(j0 + BLOCK_T, n_q), 0)
    split_len = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_hi)
    return q_start, j, h, row_ok, limit, lo, hi


@triton.jit
def _scales(kv_scale, KV_SCALE_PTR, qk_scale, SCALE_FROM_PTR: tl.constexpr):
    """(kv_scale, qk_scale·kv_scale): the cache scale from its pointer when given as a tensor."""
    if SCALE_FROM_PTR:
        kv_scale = tl.load(KV_SCALE_PTR).to(tl.float32)
    return kv_scale, qk_scale * kv_scale


@triton.jit
def _tile_rows(bt_row, start, n, n_ok, tile_ok, stride_kv_p, stride_kv_o, PAGE: tl.constexpr,
               TILE_IN_PAGE: tl.constexpr, GUARD: tl.constexpr = False, page=0, PAGE_GIVEN: tl.constexpr = False):
    """Element offsets [BLOCK_N] int64 of the cache rows of positions n (tile starting at `start`).
    GUARD: the tile may start past the range (a prefetch of the tile after the last one): its page id is
    read only when tile_ok (scalar). PAGE_GIVEN (TILE_IN_PAGE): the tile's page id is `page`, read by the
    caller one iteration ahead (_next_page)."""
    if not PAGE_GIVEN:
        if TILE_IN_PAGE:  # the tile lies in one page: one page id and one int64 base per tile
            if GUARD:
                page = tl.load(bt_row + start // PAGE, mask=tile_ok, other=0)
            else:
                page = tl.load(bt_row + start // PAGE)
        else:
            page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0)
    return page.to(tl.int64) * stride_kv_p + (n % PAGE) * stride_kv_o


@triton.jit
def _kv_tile(KV, bt_row, start, hi, d, dp, stride_kv_p, stride_kv_o, PAGE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
             BLOCK_N: tl.constexpr, D_NOPE: tl.constexpr, GUARD: tl.constexpr = False, page=0,
             PAGE_GIVEN: tl.constexpr = False):
    """The raw cache tile at positions [start, start+BLOCK_N) ∩ [.., hi): (k_nope [BLOCK_N, D_NOPE],
    k_pe [BLOCK_N, D_PE]) in the cache's dtype (0 where masked), positions n and their mask."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    row = _tile_rows(bt_row, start, n, n_ok, start < hi, stride_kv_p, stride_kv_o, PAGE, TILE_IN_PAGE, GUARD, page,
                     PAGE_GIVEN)
    k_nope = tl.load(KV + row[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    k_pe = tl.load(KV + row[:, None] + D_NOPE + dp[None, :], mask=n_ok[:, None], other=0.0)
    return k_nope, k_pe, n, n_ok


@triton.jit
def _next_page(bt_row, start, hi, PAGE: tl.constexpr):
    """The page id of the tile starting at `start` (0 when the range ends before it). Read one iteration
    before its tile (PAGE_AHEAD), so that the tile's address does not wait on a load of the same iteration:
    Triton's pipeliner then gives the tile num_stages - 1 shared buffers instead of one."""
    return tl.load(bt_row + start // PAGE, mask=start < hi, other=0)


@triton.jit
def _e4m3_to_f16_once(x):
    """uint8 e4m3 bits → fp16, 4 per register with `cvt.rn.f16x2.e4m3x2` (sm89+). Declared impure on
    purpose: Triton then converts the tile once, where it is loaded, instead of moving the conversion
    behind each dot's shared-memory read (which reads fp8 operands byte by byte and converts twice)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _upcast(x, FP8: tl.constexpr, dtype: tl.constexpr):
    """A raw cache tile (e4m3 bytes when FP8) as `dtype` values."""
    if FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _attend_tile(q_nope, q_pe, k_nope, k_pe, n, n_ok, limit, row_scale, m_i, l_i, acc, FP8: tl.constexpr,
                 FP8_ONCE: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step of rows q [M, 576] over a raw cache tile k [BLOCK_N, 576] at positions n:
    s = q·k^T · row_scale (base-2 logits), rows see positions < limit; returns the new (m_i, l_i, acc)."""
    if FP8_ONCE:  # fp16 compute only (checked by the launcher)
        k_nope = _e4m3_to_f16_once(k_nope)
        k_pe = _e4m3_to_f16_once(k_pe)
    else:
        k_nope = _upcast(k_nope, FP8, q_nope.dtype)
        k_pe = _upcast(k_pe, FP8, q_nope.dtype)
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PREC)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PREC)
    visible = n_ok[None, :] & (n[None, :] < limit[:, None])
    p, alpha, m_new, l_i = _softmax_step(s * row_scale[:, None], visible, m_i, l_i, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k_nope.dtype), k_nope, acc, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _softmax_step(s, visible, m_i, l_i, AXIS: tl.constexpr):
    """One online-softmax step over base-2 logits s whose KV positions run along AXIS ([M, BLOCK_N] with
    AXIS 1, [BLOCK_N, M] with AXIS 0); positions not `visible` are dropped. Returns (p, the factor alpha [M]
    the running sums must be rescaled by, the new max [M], the new sum [M])."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    if AXIS == 1:
        p = tl.exp2(s - m_base[:, None])
    else:
        p = tl.exp2(s - m_base[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def _write_out(acc, m_i, l_i, kv_scale, q_start, j, h, row_ok, split, d, O, LSE, O_PART, LSE_PART,
               stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
               stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
               FINAL: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """Normalise the accumulator ([M, D_NOPE], or [D_NOPE, M] when TOKEN_MAJOR) and write the output and
    lse: the final ones, or this split's fp32 partials for `_mla_combine`. Rows with nothing visible get
    lse -inf and a zero output."""
    empty = l_i == 0.0
    inv = kv_scale / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    t = (q_start + j).to(tl.int64)
    if FINAL:
        row = t * stride_o_t + h * stride_o_h
    else:
        row = t * stride_op_t + h * stride_op_h + split * stride_op_s
    if TOKEN_MAJOR:
        out = acc * inv[None, :]
        off = row[None, :] + d[:, None]
        mask = row_ok[None, :]
    else:
        out = acc * inv[:, None]
        off = row[:, None] + d[None, :]
        mask = row_ok[:, None]
    if FINAL:
        tl.store(O + off, out.to(O.dtype.element_ty), mask=mask)
        tl.store(LSE + q_start.to(tl.int64) * stride_lse_t + j * stride_lse_j + h * stride_lse_h, lse, mask=row_ok)
    else:
        tl.store(O_PART + off, out, mask=mask)
        tl.store(LSE_PART + t * stride_lp_t + h * stride_lp_h + split, lse, mask=row_ok)


@triton.jit
def _q_to_fp16(q_nope, q_pe, AXIS: tl.constexpr):
    """q rows (AXIS 1: [M, D]; AXIS 0: [D, M]) → fp16 divided by a power of two per row (≥ 1) that
    brings |q| to at most 2^14, and that factor [M] fp32. Exact rescaling: bf16 → fp16 loses nothing
    (fp16 has more mantissa bits) and no row can overflow fp16's 65504."""
    amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), AXIS), tl.max(tl.abs(q_pe.to(tl.float32)), AXIS))
    qs = tl.exp2(tl.ceil(tl.log2(tl.maximum(amax * (1.0 / 16384.0), 1.0))))
    if AXIS == 1:
        inv = (1.0 / qs)[:, None]
    else:
        inv = (1.0 / qs)[None, :]
    return (q_nope.to(tl.float32) * inv).to(tl.float16), (q_pe.to(tl.float32) * inv).to(tl.float16), qs


@triton.jit
def _q_prescale(Q, Q16, QS, stride_q_t, stride_q_h, H, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Q_SCALED: q [T, H, 576] → Q16 [T, H, 576] fp16 and QS [T, H] fp32 as `_q_to_fp16` makes them, once per
    row before the attention launch, so that the attention kernel can load q from memory per column quarter
    (kept in shared memory) instead of holding the rescaled rows in registers. Grid (T, cdiv(H, BLOCK_H))."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    d = tl.arange(0, D_NOPE)
    dp = tl.arange(0, D_PE)
    # the attention kernel's own q load and rescale (row factor times 1.0: the factor itself)
    q_nope, q_pe, qs = _load_q(Q, t, 0, h, ok, stride_q_t, stride_q_h, d, dp, 1.0, D_NOPE, BLOCK_H, True, 1)
    out = (t * H + h) * (D_NOPE + D_PE)
    tl.store(Q16 + out[:, None] + d[None, :], q_nope, mask=ok[:, None])
    tl.store(Q16 + out[:, None] + D_NOPE + dp[None, :], q_pe, mask=ok[:, None])
    tl.store(QS + t * H + h, qs, mask=ok)


@triton.jit
def _load_q(Q, q_start, j, h, row_ok, stride_q_t, stride_q_h, d, dp, scale2, D_NOPE: tl.constexpr, M: tl.constexpr,
            FP8_FP16: tl.constexpr, AXIS: tl.constexpr, QS=None, H=1, Q_SCALED: tl.constexpr = False):
    """This program's query rows: (q_nope, q_pe) as [M, D] (AXIS 1) or [D, M] (AXIS 0, token-major) and the
    per-row factor [M] fp32 the base-2 logits are multiplied by. FP8_FP16 (fp8 pools computed in fp16): q
    goes to fp16 divided per row by a power of two (_q_to_fp16), folded into that factor; with Q_SCALED
    that was done before the launch (`_q_prescale`): Q is the fp16 copy and QS [T, H] fp32 its factors."""
    q_off = (q_start + j).to(tl.int64) * stride_q_t + h * stride_q_h
    if AXIS == 1:
        q_nope = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        q_pe = tl.load(Q + q_off[:, None] + D_NOPE + dp[None, :], mask=row_ok[:, None], other=0.0)
    else:
        q_nope = tl.load(Q + q_off[None, :] + d[:, None], mask=row_ok[None, :], other=0.0)
        q_pe = tl.load(Q + q_off[None, :] + D_NOPE + dp[:, None], mask=row_ok[None, :], other=0.0)
    if Q_SCALED:
        q_scale = tl.load(QS + (q_start + j).to(tl.int64) * H + h, mask=row_ok, other=1.0)
        row_scale = scale2 * q_scale
    elif FP8_FP16:  # e4m3 -> fp16 is one conversion
        q_nope, q_pe, q_scale = _q_to_fp16(q_nope, q_pe, AXIS)
        row_scale = scale2 * q_scale
    else:
        row_scale = scale2 + tl.zeros([M], tl.float32)
    return q_nope, q_pe, row_scale


@triton.jit
def _attend_tile_t(qt_nope, qt_pe, k_nope, k_pe, v, n, n_ok, limit, row_scale, m_i, l_i, acc, FP8: tl.constexpr,
                   PREC: tl.constexpr):
    """`_attend_tile` token-major: s^T = K·q^T [BLOCK_N, M], acc [D_NOPE, M] += V^T·p^T; v is the V bytes of
    the tile (k_nope itself, or its second load with FP8_RELOAD)."""
    k_nope = _upcast(k_nope, FP8, qt_nope.dtype)
    k_pe = _upcast(k_pe, FP8, qt_nope.dtype)
    v = _upcast(v, FP8, qt_nope.dtype) if FP8 else k_nope  # bf16 V is the same tile
    s = tl.dot(k_nope, qt_nope, input_precision=PREC)  # [BLOCK_N, M]
    s = tl.dot(k_pe, qt_pe, s, input_precision=PREC)
    visible = n_ok[:, None] & (n[:, None] < limit[None, :])
    p, alpha, m_new, l_i = _softmax_step(s * row_scale[None, :], visible, m_i, l_i, 0)
    acc = acc * alpha[None, :]
    acc = tl.dot(tl.trans(v), p.to(v.dtype), acc, input_precision=PREC)  # [D_NOPE, M]
    return m_new, l_i, acc


@triton.jit
def _split4(x, R: tl.constexpr, D: tl.constexpr):
    """[R, D] → its four column quarters [R, D/4] (register relabelling, done once per program)."""
    x = tl.reshape(tl.permute(tl.reshape(x, (R, 4, D // 4)), (0, 2, 1)), (R, D // 4, 2, 2))
    even, odd = tl.split(x)  # quarters (0, 2) and (1, 3)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _q_quarters(Q, q_start, j, h, row_ok, stride_q_t, stride_q_h, D_NOPE: tl.constexpr):
    """The four column quarters [M, D_NOPE/4] of this program's q_nope rows, each its own load."""
    off = ((q_start + j).to(tl.int64) * stride_q_t + h * stride_q_h)[:, None] + tl.arange(0, D_NOPE // 4)[None, :]
    W: tl.constexpr = D_NOPE // 4
    q0 = tl.load(Q + off, mask=row_ok[:, None], other=0.0)
    q1 = tl.load(Q + off + W, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(Q + off + 2 * W, mask=row_ok[:, None], other=0.0)
    q3 = tl.load(Q + off + 3 * W, mask=row_ok[:, None], other=0.0)
    return q0, q1, q2, q3


@triton.jit
def _join4(x0, x1, x2, x3, R: tl.constexpr, D: tl.constexpr):
    """Four column quarters [R, D/4] → [R, D] (the inverse of _split4)."""
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # [R, D/4, 2, 2]: quarter 2·i + o at [.., i, o]
    return tl.reshape(tl.permute(tl.reshape(x, (R, D // 4, 4)), (0, 2, 1)), (R, D))


@triton.jit
def _kv_quarters(KV, bt_row, start, hi, stride_kv_p, stride_kv_o, PAGE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr, FP8: tl.constexpr,
                 FP8_ONCE: tl.constexpr, dtype: tl.constexpr, page, PAGE_GIVEN: tl.constexpr):
    """The cache tile at positions [start, start+BLOCK_N) ∩ [.., hi) as five separately loaded and upcast
    pieces: the four quarters of k_nope [BLOCK_N, D_NOPE/4] and k_pe [BLOCK_N, D_PE] (0 where masked),
    with the positions n and their mask."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    row = _tile_rows(bt_row, start, n, n_ok, start < hi, stride_kv_p, stride_kv_o, PAGE, TILE_IN_PAGE, False, page,
                     PAGE_GIVEN)
    W: tl.constexpr = D_NOPE // 4
    c = tl.arange(0, W)
    k0 = tl.load(KV + row[:, None] + c[None, :], mask=n_ok[:, None], other=0.0)
    k1 = tl.load(KV + row[:, None] + W + c[None, :], mask=n_ok[:, None], other=0.0)
    k2 = tl.load(KV + row[:, None] + 2 * W + c[None, :], mask=n_ok[:, None], other=0.0)
    k3 = tl.load(KV + row[:, None] + 3 * W + c[None, :], mask=n_ok[:, None], other=0.0)
    kp = tl.load(KV + row[:, None] + D_NOPE + tl.arange(0, D_PE)[None, :], mask=n_ok[:, None], other=0.0)
    if FP8_ONCE:
        return (_e4m3_to_f16_once(k0), _e4m3_to_f16_once(k1), _e4m3_to_f16_once(k2), _e4m3_to_f16_once(k3),
                _e4m3_to_f16_once(kp), n, n_ok)
    return (_upcast(k0, FP8, dtype), _upcast(k1, FP8, dtype), _upcast(k2, FP8, dtype), _upcast(k3, FP8, dtype),
            _upcast(kp, FP8, dtype), n, n_ok)


@triton.jit
def _attend_quarters(q0, q1, q2, q3, qp, k0, k1, k2, k3, kp, n, n_ok, limit, row_scale, m_i, l_i, a0, a1, a2, a3,
                     PREC: tl.constexpr, PARTIALS: tl.constexpr):
    """`_attend_tile` with q, the tile and the accumulator each in four column quarters (D_QUARTERS): one
    dot per quarter, so a quarter of q and of the tile is live at a time instead of all of it."""
    if PARTIALS:
        # five independent products summed after: five short accumulation chains of mma.sync instead of one
        # long one (programs of <= 32 rows; wgmma's bigger tiles would hold five accumulators)
        s = (tl.dot(q0, tl.trans(k0), input_precision=PREC) + tl.dot(q1, tl.trans(k1), input_precision=PREC)) \
            + (tl.dot(q2, tl.trans(k2), input_precision=PREC) + tl.dot(q3, tl.trans(k3), input_precision=PREC)) \
            + tl.dot(qp, tl.trans(kp), input_precision=PREC)
    else:
        s = tl.dot(q0, tl.trans(k0), input_precision=PREC)
        s = tl.dot(q1, tl.trans(k1), s, input_precision=PREC)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=PREC)
        s = tl.dot(q3, tl.trans(k3), s, input_precision=PREC)
        s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
    visible = n_ok[None, :] & (n[None, :] < limit[:, None])
    p, alpha, m_new, l_i = _softmax_step(s * row_scale[:, None], visible, m_i, l_i, 1)
    p = p.to(k0.dtype)
    a0 = tl.dot(p, k0, a0 * alpha[:, None], input_precision=PREC)
    a1 = tl.dot(p, k1, a1 * alpha[:, None], input_precision=PREC)
    a2 = tl.dot(p, k2, a2 * alpha[:, None], input_precision=PREC)
    a3 = tl.dot(p, k3, a3 * alpha[:, None], input_precision=PREC)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit(do_not_specialize=["num_splits"])  # auto splits follow the batch: no recompile per value class
def _mla_fwd(Q, KV, BT, SEQLENS, QO_INDPTR, O, LSE, O_PART, LSE_PART,
             kv_scale, KV_SCALE_PTR, qk_scale, QS,
             stride_q_t, stride_q_h, stride_kv_p, stride_kv_o, stride_bt_b,
             stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
             stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
             H, num_splits,
             Q_PER_SEQ: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_N: tl.constexpr, FINAL: tl.constexpr, FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
             PREC: tl.constexpr, FP8_FP16: tl.constexpr, TILE_IN_PAGE: tl.constexpr, D_NOPE: tl.constexpr,
             D_PE: tl.constexpr, TOKEN_MAJOR: tl.constexpr = False, FP8_ONCE: tl.constexpr = False,
             PREFETCH: tl.constexpr = False, FP8_RELOAD: tl.constexpr = False, D_QUARTERS: tl.constexpr = False,
             PAGE_AHEAD: tl.constexpr = False, Q_SCALED: tl.constexpr = False):
    """Row-major (q rows as the MMA's M side) or, with TOKEN_MAJOR, token-major (module docstring); FP8_ONCE,
    PREFETCH and D_QUARTERS apply to the first, FP8_RELOAD to the second, PAGE_AHEAD to all but PREFETCH;
    Q_SCALED (with FP8_FP16): Q is q already in fp16 with its per-row factors in QS (`_q_prescale`)."""
    b = tl.program_id(2)
    split = tl.program_id(1) % num_splits
    q_start, j, h, row_ok, limit, lo, hi = _program_rows(SEQLENS, QO_INDPTR, H, num_splits, Q_PER_SEQ, BLOCK_T,
                                                         BLOCK_H, BLOCK_N)
    kv_scale, scale2 = _scales(kv_scale, KV_SCALE_PTR, qk_scale, SCALE_FROM_PTR)
    M: tl.constexpr = BLOCK_T * BLOCK_H
    d = tl.arange(0, D_NOPE)
    dp = tl.arange(0, D_PE)
    # [M, D] row-major, [D, M] token-major
    q_nope, q_pe, row_scale = _load_q(Q, q_start, j, h, row_ok, stride_q_t, stride_q_h, d, dp, scale2, D_NOPE, M,
                                      FP8_FP16, 0 if TOKEN_MAJOR else 1, QS, H, Q_SCALED)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt_b
    page = 0
    if PAGE_AHEAD:  # TILE_IN_PAGE, not PREFETCH (launcher): the first tile's page id, then each next a tile ahead
        page = _next_page(bt_row, lo, hi, PAGE)
    if PREFETCH:  # software pipelining in registers: tile i+1 is in flight while tile i is computed
        acc = tl.zeros([M, D_NOPE], tl.float32)
        nx_nope, nx_pe, nx_n, nx_ok = _kv_tile(KV, bt_row, lo, hi, d, dp, stride_kv_p, stride_kv_o, PAGE,
                                               TILE_IN_PAGE, BLOCK_N, D_NOPE, True)
        for start in range(lo, hi, BLOCK_N):
            k_nope, k_pe, n, n_ok = nx_nope, nx_pe, nx_n, nx_ok
            nx_nope, nx_pe, nx_n, nx_ok = _kv_tile(KV, bt_row, start + BLOCK_N, hi, d, dp, stride_kv_p, stride_kv_o,
                                                   PAGE, TILE_IN_PAGE, BLOCK_N, D_NOPE, True)
            m_i, l_i, acc = _attend_tile(q_nope, q_pe, k_nope, k_pe, n, n_ok, limit, row_scale, m_i, l_i, acc,
                                         FP8, FP8_ONCE, PREC)
    else:
        # the accumulator: [D_NOPE, M] token-major, four column quarters [M, D_NOPE/4], else [M, D_NOPE]
        if TOKEN_MAJOR:
            acc = tl.zeros([D_NOPE, M], tl.float32)
        elif D_QUARTERS:
            if FP8_FP16 and not Q_SCALED:  # q was rescaled per row in registers: split it there
                q0, q1, q2, q3 = _split4(q_nope, M, D_NOPE)
            else:  # loaded per quarter: Triton keeps loaded operands in shared memory instead of 128 registers
                q0, q1, q2, q3 = _q_quarters(Q, q_start, j, h, row_ok, stride_q_t, stride_q_h, D_NOPE)
            a0 = tl.zeros([M, D_NOPE // 4], tl.float32)
            a1 = tl.zeros([M, D_NOPE // 4], tl.float32)
            a2 = tl.zeros([M, D_NOPE // 4], tl.float32)
            a3 = tl.zeros([M, D_NOPE // 4], tl.float32)
        else:
            acc = tl.zeros([M, D_NOPE], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            if PAGE_AHEAD:
                page_nx = _next_page(bt_row, start + BLOCK_N, hi, PAGE)
            if D_QUARTERS and not TOKEN_MAJOR:
                k0, k1, k2, k3, kp, n, n_ok = _kv_quarters(KV, bt_row, start, hi, stride_kv_p, stride_kv_o, PAGE,
                                                           TILE_IN_PAGE, BLOCK_N, D_NOPE, D_PE, FP8, FP8_ONCE,
                                                           q_nope.dtype, page, PAGE_AHEAD)
                m_i, l_i, a0, a1, a2, a3 = _attend_quarters(q0, q1, q2, q3, q_pe, k0, k1, k2, k3, kp, n, n_ok,
                                                            limit, row_scale, m_i, l_i, a0, a1, a2, a3, PREC,
                                                            M <= 32)
            else:
                k_nope, k_pe, n, n_ok = _kv_tile(KV, bt_row, start, hi, d, dp, stride_kv_p, stride_kv_o, PAGE,
                                                 TILE_IN_PAGE, BLOCK_N, D_NOPE, False, page, PAGE_AHEAD)
                if TOKEN_MAJOR:
                    if FP8_RELOAD:  # a distinct load (cache modifier): not merged with k_nope by CSE
                        row = _tile_rows(bt_row, start, n, n_ok, True, stride_kv_p, stride_kv_o, PAGE, TILE_IN_PAGE,
                                         False, page, PAGE_AHEAD)
                        v = tl.load(KV + row[:, None] + d[None, :], mask=n_ok[:, None], other=0.0,
                                    cache_modifier=".cg")
                    else:
                        v = k_nope
                    m_i, l_i, acc = _attend_tile_t(q_nope, q_pe, k_nope, k_pe, v, n, n_ok, limit, row_scale, m_i,
                                                   l_i, acc, FP8, PREC)
                else:
                    m_i, l_i, acc = _attend_tile(q_nope, q_pe, k_nope, k_pe, n, n_ok, limit, row_scale, m_i, l_i,
                                                 acc, FP8, FP8_ONCE, PREC)
            if PAGE_AHEAD:
                page = page_nx
        if D_QUARTERS and not TOKEN_MAJOR:
            acc = _join4(a0, a1, a2, a3, M, D_NOPE)

    _write_out(acc, m_i, l_i, kv_scale, q_start, j, h, row_ok, split, d, O, LSE, O_PART, LSE_PART,
               stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
               stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h, FINAL, TOKEN_MAJOR)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_combine(O_PART, LSE_PART, COUNTS, O, LSE, stride_op_b, stride_op_j, stride_op_h, stride_op_s,
                 stride_lp_b, stride_lp_j, stride_lp_h, stride_lp_s, stride_o_t, stride_o_h,
                 stride_lse_b, stride_lse_s, stride_lse_h, stride_cnt, num_splits,
                 SQ: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, COUNTED: tl.constexpr):
    """Token t = b·SQ + j, head h: the lse-weighted merge of its num_splits partials (addressed by sequence b, token
    j, head and split), or with COUNTED of the first COUNTS[b] of them (the balanced schedule; a sequence of one
    program already has its result). Only the partials below the count are read (unwritten ones never are)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = t // SQ
    j = t % SQ
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    count = num_splits
    if COUNTED:
        count = tl.minimum(tl.load(COUNTS + b * stride_cnt), num_splits)
    if count > 1:
        s_ok = s < count
        lse = tl.load(LSE_PART + b * stride_lp_b + j * stride_lp_j + h * stride_lp_h + s * stride_lp_s, mask=s_ok,
                      other=float("-inf"))
        part = tl.load(O_PART + b * stride_op_b + j * stride_op_j + h * stride_op_h + s[:, None] * stride_op_s
                       + d[None, :], mask=s_ok[:, None], other=0.0)
        mx = tl.max(lse, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp(lse - mx)
        tot = tl.sum(w, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(tot == 0.0, 1.0, tot)
        tl.store(O + t * stride_o_t + h * stride_o_h + d, out.to(O.dtype.element_ty))
        lse_out = tl.where(tot == 0.0, float("-inf"), mx + tl.log(tl.where(tot == 0.0, 1.0, tot)))
        tl.store(LSE + b * stride_lse_b + j * stride_lse_s + h * stride_lse_h, lse_out)


@triton.jit
def _store_kv(KV, SLOTS, LAT, scale, SCALE_PTR, stride_kv_p, stride_kv_o, stride_lat_t, n_slots,
              PAGE: tl.constexpr, FP8: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
              D_NOPE: tl.constexpr, D_PE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    ok = (slot >= 0) & (slot < n_slots)
    slot = tl.where(ok, slot, 0)
    dst = KV + (slot // PAGE) * stride_kv_p + (slot % PAGE) * stride_kv_o
    if SCALE_FROM_PTR:
        scale = tl.load(SCALE_PTR).to(tl.float32)
    d = tl.arange(0, D_NOPE)
    dp = D_NOPE + tl.arange(0, D_PE)
    width = tl.where(ok, D_NOPE + D_PE, 0)  # a vector mask (scalar masks trip the interpreter)
    m = d < width
    mp = dp < width
    x = tl.load(LAT + t * stride_lat_t + d, mask=m, other=0.0)
    xp = tl.load(LAT + t * stride_lat_t + dp, mask=mp, other=0.0)
    if FP8:
        x = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        xp = tl.clamp(tl.div_rn(xp.to(tl.float32), scale), -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(dst + d, x.to(KV.dtype.element_ty), mask=m)
    tl.store(dst + dp, xp.to(KV.dtype.element_ty), mask=mp)


@triton.jit
def _dequant_pages(KV, BT, OUT, scale, SCALE_PTR, n_pages, stride_kv_p, stride_kv_o, stride_out_p, stride_out_o,
                   SCALE_FROM_PTR: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr):
    """Grid (entries of the block table, rows of a page): row r of the page that entry i names, e4m3 bytes times the
    scale, into row r of page i of OUT in OUT's dtype. Page ids outside [0, n_pages) read page 0 (the entries past a
    sequence's pages are never attended)."""
    i = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    page = tl.load(BT + i).to(tl.int64)
    page = tl.where((page >= 0) & (page < n_pages), page, 0)
    if SCALE_FROM_PTR:
        scale = tl.load(SCALE_PTR).to(tl.float32)
    src = KV + page * stride_kv_p + r * stride_kv_o
    dst = OUT + i * stride_out_p + r * stride_out_o
    d = tl.arange(0, D_NOPE)
    dp = D_NOPE + tl.arange(0, D_PE)
    x = tl.load(src + d).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    xp = tl.load(src + dp).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    tl.store(dst + d, x.to(OUT.dtype.element_ty))
    tl.store(dst + dp, xp.to(OUT.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# launchers

_DEVICE: dict[int, tuple[int, bool]] = {}


def _device_facts(device: torch.device) -> tuple[int, bool]:
    """(SM count, has the e4m3x2 → f16x2 conversion (sm89+)) of a CUDA device, read once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE:
        props = torch.cuda.get_device_properties(idx)
        _DEVICE[idx] = (props.multi_processor_count, (props.major, props.minor) >= (8, 9))
    return _DEVICE[idx]


def _ptx_e4m3(device: torch.device) -> bool:
    """Whether kernels for `device` may use the PTX e4m3 → f16 conversion: a CUDA GPU of sm89+, not under the
    Triton interpreter (which cannot run inline PTX)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _device_facts(device)[1]


def _sm_count(device: torch.device) -> int:
    return _device_facts(device)[0] if device.type == "cuda" else 4


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _scale_args(kv_scale, device):
    """(float scale, pointer or None, from_ptr) — a tensor scale stays on the device (graph-safe)."""
    if isinstance(kv_scale, torch.Tensor):
        return 1.0, kv_scale.to(device=device, dtype=torch.float32).reshape(1), True
    return (1.0 if kv_scale is None else float(kv_scale)), None, False


def _tile(H: int, BLOCK_T: int, BLOCK_H: int, uniform: bool) -> tuple[int, int]:
    """(query tokens, heads) per program. Decode (uniform S_q) keeps the rows BLOCK_T*heads at the
    configured BLOCK_H (heads = BLOCK_H / S_q) so that S_q > 1 costs no extra registers or shared
    memory; prefill uses BLOCK_T x BLOCK_H as configured. Heads never exceed H (power of two) and
    rows are at least 16 for tl.dot."""
    bh = _pow2_at_least(BLOCK_H)
    if uniform:
        bh = max(1, bh // BLOCK_T)
    bh = min(bh, _pow2_at_least(H))
    return BLOCK_T, max(bh, 16 // BLOCK_T if BLOCK_T < 16 else 1)


def auto_splits(B: int, head_blocks: int, q_blocks: int, capacity: int, device: torch.device,
                waves: float = 2.0, min_tokens: int = 256, within: bool = False) -> int:
    """Splits of each sequence's KV so that programs fill the SMs about `waves` times (within: the most splits
    whose programs still fit in `waves` waves, so a launch of fewer programs than SMs is split only as far as
    it fills them: prefill, whose causal q-blocks are uneven), never giving a split fewer than `min_tokens`
    of the pool capacity."""
    programs = max(B * head_blocks * q_blocks, 1)
    want = int(waves * _sm_count(device) // programs) if within else math.ceil(waves * _sm_count(device) / programs)
    return int(max(1, min(want, capacity // min_tokens, 64)))


def mla_attention(q3: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
                  qo_indptr: torch.Tensor | None, out3: torch.Tensor, lse: torch.Tensor,
                  lse_strides: tuple[int, int, int], softmax_scale: float, kv_scale, *, q_per_seq: int,
                  q_blocks: int, config: dict) -> None:
    """Launch `_mla_fwd` (+ `_mla_combine` when split).

    q3: [T, H, 576] view of the queries; out3: [T, H, 512] view of the output; lse written through
    lse_strides = (per first-token-of-sequence, per token in sequence, per head), which for decode
    addresses [B, H, S_q] and for prefill [T, H]. q_per_seq > 0: uniform (decode), 0: ragged."""
    T, H, _ = q3.shape
    B = seqlens.shape[0]
    dev = q3.device
    block_t = _pow2_at_least(q_per_seq) if q_per_seq > 0 else int(config.get("BLOCK_T", 1))
    block_t, block_h = _tile(H, block_t, int(config["BLOCK_H"]), q_per_seq > 0)
    fp8 = kv_cache.dtype == torch.uint8
    capacity = block_table.shape[1] * kv_cache.shape[1]
    gluon = _gluon_kernel(config, fp8, q_per_seq, H, q3, kv_cache, B, capacity)
    if gluon == "fp8":
        block_h = H  # one program holds every query row of its sequence
    elif gluon in ("wide", "seesaw"):
        from pdlab.attention import gluon_mla_wide

        block_h = gluon_mla_wide.ROWS // q_per_seq  # the kernel's query rows per program
    head_blocks = triton.cdiv(H, block_h)
    schedule = config.get("schedule", "auto")
    if schedule not in ("auto", "balanced", "uniform"):
        raise ValueError(f"mla triton: schedule={schedule!r} is not a schedule: use 'auto' (balanced from "
                         "32 sequences), 'balanced' or 'uniform' (the fp8 Gluon decode's splits)")
    if gluon == "fp8" and schedule != "uniform":
        from pdlab.attention import gluon_mla

        slots = gluon_mla.programs_per_sm(gluon_mla.program_rows(H, q_per_seq),
                                          gluon_mla.QPARTS_OF[q3.dtype]) * _sm_count(dev)
        wanted = schedule == "balanced" or B >= gluon_mla.BALANCED_MIN_BATCH
        if wanted and gluon_mla.balanced_fits(B, slots):
            _fp8_balanced(q3, kv_cache, block_table, seqlens, out3, lse, lse_strides, softmax_scale, kv_scale,
                          q_per_seq, slots)
            return
    splits = int(config.get("num_splits", 0) or 0)
    waves = float(config.get("waves") or 0)
    if splits <= 0 and gluon == "fp8" and not waves:  # auto: the split count that fills the kernel's slots best
        from pdlab.attention import gluon_mla

        splits = gluon_mla.auto_splits(B, H, q_per_seq, capacity, _sm_count(dev),
                                       qparts=gluon_mla.QPARTS_OF[q3.dtype])
    elif gluon in ("wide", "seesaw"):
        splits = _wide_splits(config, B, head_blocks, q_blocks, capacity, dev, gluon == "seesaw")
    elif splits <= 0:  # waves 0 (auto): by rows (`_warps` resolved it)
        waves = waves or (7.5 if block_t * block_h <= 32 else 2.0)
        splits = auto_splits(B, head_blocks, q_blocks, capacity, dev, waves, within=q_per_seq == 0)
    scale, scale_ptr, from_ptr = _scale_args(kv_scale if fp8 else None, dev)
    prec = "ieee" if q3.dtype == torch.float32 else None  # fp32 oracle checks must not use tf32
    final = splits == 1
    if final:
        o_part = lse_part = out3  # unused
        sp = (0, 0, 0, 0, 0)
    else:
        o_part = torch.empty(T, H, splits, 512, dtype=torch.float32, device=dev)
        lse_part = torch.empty(T, H, splits, dtype=torch.float32, device=dev)
        sp = (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))
    if gluon in ("wide", "seesaw"):
        from pdlab.attention import gluon_mla_wide

        gluon_mla_wide.launch(q3, kv_cache, block_table, seqlens, out3, lse, o_part, lse_part, lse_strides, sp,
                              softmax_scale * LOG2E, q_per_seq=q_per_seq, splits=splits, kv_scale=scale,
                              kv_scale_ptr=scale_ptr if from_ptr else None,
                              conv_group=int(config.get("conv_group", gluon_mla_wide.CONV_GROUP)),
                              tma3=bool(int(config.get("tma3", gluon_mla_wide.TMA3))),
                              seesaw=gluon == "seesaw")
        _combine(out3, lse, o_part, lse_part, sp, lse_strides, q_per_seq, splits, final)
        return
    if gluon == "fp8":
        from pdlab.attention import gluon_mla

        gluon_mla.launch(q3, kv_cache, block_table, seqlens, out3, lse, o_part, lse_part, lse_strides, sp,
                         softmax_scale * LOG2E, scale, scale_ptr if from_ptr else None, q_per_seq=q_per_seq,
                         splits=splits)
        _combine(out3, lse, o_part, lse_part, sp, lse_strides, q_per_seq, splits, final)
        return
    grid = (head_blocks, q_blocks * splits, B)
    page, block_n = kv_cache.shape[1], int(config["BLOCK_N"])
    token_major = bool(int(config.get("swap_ab", 0) or 0))
    if token_major and block_n >= 64 and int(config["num_stages"]) < 2:
        # seen on an H200 (Triton 3.6): an out-of-bounds fault that leaves the CUDA context unusable (the
        # message avoids the fault's own words: the tuner reads those as a broken context)
        raise ValueError(f"mla triton: swap_ab=1 with BLOCK_N={block_n} and num_stages={config['num_stages']} "
                         "faulted on sm90 (out-of-bounds access); use num_stages >= 2, BLOCK_N <= 32 or swap_ab=0")
    fp16 = fp8 and config.get("fp8_compute", "bf16") == "fp16" and q3.dtype != torch.float32
    if token_major:
        extra = {"FP8_RELOAD": fp8 and bool(int(config.get("fp8_reload", 0) or 0))}
    else:  # the PTX conversion needs a GPU (sm89+): the interpreter runs the plain upcast
        upcast = config.get("fp8_upcast", "inline")
        extra = {"FP8_ONCE": fp16 and upcast in ("once", "prefetch") and _ptx_e4m3(dev),
                 "PREFETCH": fp8 and upcast == "prefetch"}
        extra["D_QUARTERS"] = not extra["PREFETCH"] and bool(int(config.get("d_quarters", 0) or 0))
    # q to fp16 per row before the launch (q_prescale): the column-quarter kernel then loads q per quarter
    q_in, qs = q3, seqlens
    if fp16 and not token_major and extra["D_QUARTERS"] and bool(int(config.get("q_prescale", 0) or 0)):
        q_in = torch.empty(T, H, 576, dtype=torch.float16, device=dev)
        qs = torch.empty(T, H, dtype=torch.float32, device=dev)
        _q_prescale[(T, triton.cdiv(H, 16))](q3, q_in, qs, q3.stride(0), q3.stride(1), H, D_NOPE=512, D_PE=64,
                                             BLOCK_H=16, num_warps=4)
        extra["Q_SCALED"] = True
    tile_in_page = page % block_n == 0 and bool(int(config.get("tile_in_page", 1)))
    # the page id a tile ahead: row-major without the register prefetch (which has its own), or token-major
    extra["PAGE_AHEAD"] = (tile_in_page and bool(int(config.get("page_ahead", 0) or 0))
                           and not extra.get("PREFETCH", False))
    try:
        _mla_fwd[grid](
            q_in, kv_cache, block_table, seqlens, qo_indptr if qo_indptr is not None else seqlens,
            out3, lse, o_part, lse_part, scale, scale_ptr if from_ptr else seqlens, softmax_scale * LOG2E, qs,
            q_in.stride(0), q_in.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            out3.stride(0), out3.stride(1), *lse_strides, *sp, H, splits,
            Q_PER_SEQ=q_per_seq, PAGE=page, BLOCK_T=block_t, BLOCK_H=block_h,
            BLOCK_N=block_n, FINAL=final, FP8=fp8, SCALE_FROM_PTR=from_ptr, PREC=prec,
            FP8_FP16=fp16,
            TILE_IN_PAGE=tile_in_page,
            D_NOPE=512, D_PE=64, TOKEN_MAJOR=token_major, num_warps=int(config["num_warps"]),
            num_stages=int(config["num_stages"]), **extra)
    except OutOfResources as e:
        raise ValueError(f"mla triton: the config needs more shared memory than the GPU has ({e}); "
                         f"{block_n} KV tokens per tile, {block_t * block_h} rows per program, num_stages "
                         f"{config['num_stages']}, page_ahead {int(extra.get('PAGE_AHEAD', False))} (which keeps "
                         "num_stages - 1 tiles in flight): lower num_stages, BLOCK_N or BLOCK_H, "
                         "or set page_ahead=0") from None
    _combine(out3, lse, o_part, lse_part, sp, lse_strides, q_per_seq, splits, final)


def _fp8_balanced(q3, kv_cache, block_table, seqlens, out3, lse, lse_strides, softmax_scale, kv_scale,
                  q_per_seq: int, slots: int) -> None:
    """The fp8 Gluon decode on the balanced schedule (gluon_mla `_balanced_span`: the KV tiles of the whole batch
    spread over one wave of `slots` programs by the lengths), then `_mla_combine` over each sequence's count."""
    from pdlab.attention import gluon_mla

    T, H, _ = q3.shape
    B = seqlens.shape[0]
    scale, scale_ptr, from_ptr = _scale_args(kv_scale, q3.device)
    splits = gluon_mla.balanced_max_splits(B, slots, block_table.shape[1] * kv_cache.shape[1])
    meta = torch.empty(B, 2, dtype=torch.int32, device=q3.device)
    o_part, lse_part = balanced_partials(B, splits, q_per_seq, H, q3.device)
    # the kernel writes partial row (b·splits + split)·S_q + j: the rows of the [B, splits, S_q] leading dimensions
    sp = (o_part.stride(2), o_part.stride(3), 0, lse_part.stride(2), lse_part.stride(3))
    gluon_mla.launch(q3, kv_cache, block_table, seqlens, out3, lse, o_part, lse_part, lse_strides, sp,
                     softmax_scale * LOG2E, scale, scale_ptr if from_ptr else None, q_per_seq=q_per_seq,
                     splits=splits, meta=meta, slots=slots)
    _combine(out3, lse, o_part, lse_part, sp, lse_strides, q_per_seq, splits, False, counts=meta[:, 1])


def balanced_partials(batch: int, splits: int, q_per_seq: int, heads: int, device) -> tuple[torch.Tensor, ...]:
    """The balanced schedule's fp32 partials: o_part [B, splits, S_q, H, 512] and lse_part [B, splits, S_q, H]
    (a sequence's programs past its count leave theirs unwritten)."""
    o_part = torch.empty(batch, splits, q_per_seq, heads, 512, dtype=torch.float32, device=device)
    lse_part = torch.empty(batch, splits, q_per_seq, heads, dtype=torch.float32, device=device)
    return o_part, lse_part


def _combine(out3, lse, o_part, lse_part, sp, lse_strides, q_per_seq: int, splits: int, final: bool,
             counts: torch.Tensor | None = None) -> None:
    """`_mla_combine` of the splits' partials into out3 and lse (nothing to do with one split). sp: the partials'
    strides as the kernels take them (o_part's token, head, split; lse_part's token, head); with `counts` [B] int32
    (programs per sequence) the partials are `balanced_partials`' [B, splits, S_q, H(, 512)] and sp unused."""
    if final:
        return
    T, H = out3.shape[:2]
    sq = max(q_per_seq, 1)
    if counts is None:  # token t = b·SQ + j at t · (token stride); lse_part's splits adjacent
        part = (sp[0] * sq, sp[0], sp[1], sp[2], sp[3] * sq, sp[3], sp[4], 1)
    else:
        part = (o_part.stride(0), o_part.stride(2), o_part.stride(3), o_part.stride(1),
                lse_part.stride(0), lse_part.stride(2), lse_part.stride(3), lse_part.stride(1))
    # combine addresses lse by (token // SQ, token % SQ, head)
    lse_b = lse_strides[0] * sq if q_per_seq > 0 else lse_strides[0]
    lse_s = lse_strides[1] if q_per_seq > 0 else 0
    _mla_combine[(T, H)](o_part, lse_part, counts if counts is not None else lse_part, out3, lse, *part,
                         out3.stride(0), out3.stride(1), lse_b, lse_s, lse_strides[2],
                         counts.stride(0) if counts is not None else 0, splits, SQ=sq,
                         BLOCK_S=_pow2_at_least(splits), D=512, COUNTED=counts is not None, num_warps=4)


def _wide_splits(config: dict, B: int, head_blocks: int, q_blocks: int, capacity: int, dev: torch.device,
                 seesaw: bool) -> int:
    """The 64-row kernels' split count: the config's `num_splits`, else with `waves` set the waves rule
    (`auto_splits`), else gluon_mla_wide.auto_splits on this device's SMs (`seesaw`: the two-warpgroup kernels'
    cap)."""
    from pdlab.attention import gluon_mla_wide

    splits = int(config.get("num_splits", 0) or 0)
    waves = float(config.get("waves") or 0)
    if splits > 0:
        return splits
    if waves:
        return auto_splits(B, head_blocks, q_blocks, capacity, dev, waves)
    return gluon_mla_wide.auto_splits(B, head_blocks, capacity, _sm_count(dev), seesaw)


def _fp8_seesaw_pays(config: dict, q_per_seq: int, H: int, dev: torch.device, B: int | None,
                     capacity: int | None) -> bool:
    """Whether the two-warpgroup kernel runs an fp8 decode of B sequences over a pool of `capacity` tokens each:
    where a split holds more than gluon_mla_wide.SEESAW_FP8_MIN_TILES tiles at the split count its launch would
    take (`_wide_splits`). Unknown B or capacity: it does."""
    from pdlab.attention import gluon_mla_wide

    if B is None or capacity is None:
        return True
    splits = _wide_splits(config, B, H // (gluon_mla_wide.ROWS // q_per_seq), 1, capacity, dev, True)
    return -(-capacity // (gluon_mla_wide.BLOCK_N * splits)) > gluon_mla_wide.SEESAW_FP8_MIN_TILES


def _gluon_kernel(config: dict, fp8: bool, q_per_seq: int, H: int, q3: torch.Tensor,
                  kv_cache: torch.Tensor, B: int | None = None, capacity: int | None = None) -> str | None:
    """Which Gluon decode kernel this launch runs: "fp8" (attention/gluon_mla.py: sm90, an fp8 pool, heads × S_q ≤ 32,
    16-bit queries), "wide" (attention/gluon_mla_wide.py: sm90, a contiguous pool of page 64/128 — bf16/fp16 with
    queries of its dtype, or fp8 —, heads × S_q in programs of 64 rows), "seesaw" (those programs with config
    "seesaw" on, the default, over a bf16/fp16 pool — attention/gluon_mla_seesaw.py — or over an fp8 pool with bf16
    queries where its splits are long enough (`_fp8_seesaw_pays`: B sequences, `capacity` tokens each) —
    attention/gluon_mla_seesaw_fp8.py —; launched by the wide kernel's launcher) or None (`_mla_fwd`). Config
    "kernel": "gluon" runs the one that fits (ValueError with both reasons where none does), "auto" likewise but
    falls back to `_mla_fwd`, "triton" never runs one."""
    kernel = str(config.get("kernel", "triton"))
    if kernel == "triton":
        return None
    if kernel not in ("auto", "gluon"):
        raise ValueError(f"mla triton: kernel={kernel!r}; use 'triton', 'gluon' or 'auto'")
    from pdlab.attention import gluon_mla, gluon_mla_wide

    why = gluon_mla.unfit(H, q_per_seq, fp8) or gluon_mla.available(q3.device, q3.dtype)
    if why is None:
        return "fp8"
    why_wide = (gluon_mla_wide.unfit(H, q_per_seq, kv_cache.dtype, q3.dtype, kv_cache.shape[1])
                or gluon_mla_wide.available(q3.device, q3.dtype)
                or (None if kv_cache.is_contiguous() else "the pool is not contiguous (it is read by TMA)"))
    if why_wide is None:
        if int(config.get("seesaw", gluon_mla_wide.SEESAW)):
            from pdlab.attention import gluon_mla_seesaw_fp8

            if not fp8 or (gluon_mla_seesaw_fp8.unfit(q3.dtype) is None
                           and _fp8_seesaw_pays(config, q_per_seq, H, q3.device, B, capacity)):
                return "seesaw"
        return "wide"
    if kernel == "gluon":
        raise ValueError(f"mla triton: kernel='gluon' cannot run here: fp8 kernel: {why}; 16-bit kernel: "
                         f"{why_wide}; use kernel='triton' or 'auto'")
    return None


def dequantize_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, kv_scale,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a block table names, dequantised once into a pool of their own (prefill over an fp8 pool: every
    query block and head block of a launch reads the same KV tiles, so converting them in the attention kernel
    repeats the conversion per program).

    kv_cache: [P, page, 576] uint8 (e4m3 bytes); block_table: [B, W] int32 (ids outside [0, P) read page 0);
    kv_scale: float or 0-dim/1-element fp32 tensor; dtype: bf16 or fp32.
    Returns (pool [B·W, page, 576] dtype = e4m3 · kv_scale, table [B, W] int32 = arange: entry (b, w) is page
    b·W + w of the new pool). No host sync; CUDA-graph safe."""
    B, W = block_table.shape
    P, page, _ = kv_cache.shape
    pool = torch.empty(B * W, page, 576, dtype=dtype, device=kv_cache.device)
    table = torch.arange(B * W, dtype=torch.int32, device=kv_cache.device).view(B, W)
    if B * W == 0:
        return pool, table
    scale, scale_ptr, from_ptr = _scale_args(kv_scale, kv_cache.device)
    bt = block_table.contiguous()
    _dequant_pages[(B * W, page)](kv_cache, bt, pool, scale, scale_ptr if from_ptr else bt, P,
                                  kv_cache.stride(0), kv_cache.stride(1), pool.stride(0), pool.stride(1),
                                  SCALE_FROM_PTR=from_ptr, D_NOPE=512, D_PE=64, num_warps=4)
    return pool, table


def store_kv(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, kv_scale) -> None:
    """Launch `_store_kv`: one program per row of `latent` [T, 576] into `kv_cache` [P, page, 576]."""
    fp8 = kv_cache.dtype == torch.uint8
    scale, scale_ptr, from_ptr = _scale_args(kv_scale if fp8 else None, kv_cache.device)
    T = slots.shape[0]
    P, page, _ = kv_cache.shape
    _store_kv[(T,)](kv_cache, slots, latent, scale, scale_ptr if from_ptr else slots,
                    kv_cache.stride(0), kv_cache.stride(1), latent.stride(0), P * page,
                    PAGE=page, FP8=fp8, SCALE_FROM_PTR=from_ptr, D_NOPE=512, D_PE=64, num_warps=4)
