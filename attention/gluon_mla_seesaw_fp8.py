"""MLA decode for Hopper (sm90) in Gluon over an fp8 (e4m3) paged cache, 64 query rows per program, the two
warpgroups on alternate tiles: gluon_mla_seesaw's schedule for fp8 pools.

Why: the wide kernel (gluon_mla_wide) converts each fp8 tile whole into one fp16 tile [64, 576] that both
warpgroups read, behind a CTA barrier, before q·k can start; at 128 heads on an H200 it took 0.80 ms at B=128, 8k
against 0.52 ms for a bf16 pool under the two-warpgroup schedule. The seesaw's shared memory (q, two tiles, 225 KB)
has no room for a 16-bit copy of each warpgroup's tile. Here nothing of q·k is converted:

- q is stored as two e4m3 parts (hi, lo) [2, 64, 576] whose sum is the row scaled by a power of two into
  (128, 256] (gluon_mla's `_e4m3_value`: exact for bf16 values of that range; 72 KB, as a 16-bit q), and s = q·K^T
  runs as e4m3 × e4m3 wgmma straight from the TMA ring (both operands K-major in shared memory). fp8 wgmma adds
  into its accumulator in fewer bits than fp32 (about 2^-13 of the largest of the accumulator and the step's
  products), so the 576 columns go to two accumulators (latent columns 0–255; 256–511 and the rope), added in
  fp32, and each chain takes the lo part's columns before the hi part's: the small terms are added while the
  accumulator is still small.
- p·V needs V in 16 bits (p is kept in fp16): each warpgroup converts only the half of V it multiplies (its 256
  output columns, 64 × 256 values a tile: 64 `cvt.rn.f16x2.e4m3x2` a thread) into its own fp16 buffer [64, 256]
  (32 KB), made visible to its wgmma by a fence and a barrier of its own four warps — not the CTA's — and zeroing
  the rows past the split end on the last tile. A ring slot goes back to the TMA once both warpgroups have
  converted their halves of it and the owner's q·k is done, before either p·V.
- The schedule is the seesaw's: the left warpgroup (default partition) takes the even tiles, the right one the odd
  tiles and the refills; p0 / m0 and p1 / m1 are exchanged through shared memory and two mbarriers; each holds o
  [64, 256] fp32 of its columns for every tile. Per pair, left: q·k of tile 2j with V0's left half converted under
  it, softmax, p0·V0_L, then V1's left half converted while the right warpgroup runs its softmax, p1·V1_L. Right:
  q·k of tile 2j+1 with V0's right half converted under it, p0·V0_R issued before its softmax, V1's right half,
  p1·V1_R, refills.

Shared memory: q's parts 72 KB, two fp8 tiles 72 KB, the two fp16 halves 64 KB, p 8 KB, row maxima and q's
factors 0.75 KB (217 of the 227 KiB an sm90 program may have). bf16 queries only (fp16 values need four e4m3 parts,
144 KB); the wide kernel takes fp16 queries over fp8 pools.

On an H200 at 128 heads (bench/results/NVIDIA_H200/attention/2026-12-02_seesaw_fp8), against the wide kernel:
B=128 at 8k 0.805 → 0.698 ms (418 TFLOPS), 16k 1.580 → 1.373, 4k 0.416 → 0.382; B=64 8k 0.413 → 0.363. Its
programs cost more to start and finish (about 25 µs against 14), so it loses on short splits (B=128 1k 0.128 →
0.151 ms): the launcher runs it only where a split holds more than gluon_mla_wide.SEESAW_FP8_MIN_TILES tiles.

The result and lse, or per-split fp32 partials for triton_kernels' `_mla_combine` (the wide kernel's output
contract); the output scaled by the pool's kv_scale.
"""

from __future__ import annotations

import torch

from pdlab.attention import gluon_mla_wide as W

QPARTS = 2  # e4m3 parts of a bf16 query element (gluon_mla.QPARTS_OF)


def unfit(q_dtype: torch.dtype) -> str | None:
    """None when the kernel takes queries of `q_dtype` over an fp8 pool (the rest of the problem as
    gluon_mla_wide.unfit), else why not."""
    if q_dtype != torch.bfloat16:
        return f"{q_dtype} queries: the fp8 seesaw kernel holds q as two e4m3 parts, exact for bf16 values only"
    return None


def shared_bytes() -> int:
    """Shared memory of one program: q's two e4m3 parts and two fp8 tiles (72 KB each), the two warpgroups' fp16 V
    halves (32 KB each), p (8 KB), row maxima and q's factors."""
    return QPARTS * 64 * 576 + 2 * 64 * 576 + 2 * 64 * 256 * 2 + 64 * 64 * 2 + 3 * 64 * 4


if W.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from pdlab.attention.gluon_mla import _e4m3_value, _program_span
    from pdlab.attention.gluon_mla_seesaw import (MMA_S, PL, QL, RO, RS, WARPS, _VEC, _begin, _factor, _online,
                                                  _q_rows, _refill, _right_exchange, _ring, _send, _store_half,
                                                  _sums_left, _sums_right)
    from pdlab.attention.gluon_mla_wide import _TILE16, _cta_barrier, _scores

    # the q·k accumulator of e4m3 wgmma (K 32 an instruction): the same registers as MMA_S's
    MMA_S8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
    _QPARTS = gl.constexpr(QPARTS)
    # the right warpgroup's registers a thread: all 256, as the left's (with 248 ptxas spilled 4 bytes; the 16-bit
    # seesaw gives its right warpgroup 240)
    RIGHT_REGS_FP8 = gl.constexpr(256)
    _Q8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))  # the ring's
    CL = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))  # converting [64, 64]: 16 bytes a thread

    @gluon.jit
    def _chain(qn, qp, nope, pe, z, slot, FIRST: gl.constexpr, LAST: gl.constexpr, ROPE: gl.constexpr, s):
        """Issue one accumulator's share of s = q·K^T: latent blocks FIRST..LAST-1 (and, ROPE, the rope block) of
        q's lo part (index 0), then the same of its hi part (index 1): e4m3 × e4m3 from shared memory."""
        for part in gl.static_range(_QPARTS):
            for c in gl.static_range(FIRST, LAST):
                s = warpgroup_mma(qn.index(2 * z + part).slice(c * 64, 64, dim=1),
                                  nope.index(slot + z).slice(c * 64, 64, dim=1).permute((1, 0)), s,
                                  use_acc=part * 8 + c > FIRST, is_async=True)
            if ROPE:
                s = warpgroup_mma(qp.index(2 * z + part), pe.index(slot + z).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _tile_scores(qn, qp, nope, pe, bars, slot, z, phase, start, hi, limit, row_scale, tok, v16, cslot,
                     cstart, HALF: gl.constexpr):
        """The masked, scaled scores [64, 64] (base 2) of the tile at `start` in ring slot `slot` once it has
        landed; under its q·k this warpgroup's half of the V of the tile at `cstart` in ring slot `cslot` (landed,
        the caller's wait) converted into v16 and made visible to its wgmmas. z: the pair index >> 24, 0 for any
        int32 length but not known to the compiler to be (gluon_mla_seesaw `_tile_scores`)."""
        mbarrier.wait(bars.index(slot), phase)
        zero = gl.zeros([64, 64], gl.float32, layout=MMA_S8)
        sa = _chain(qn, qp, nope, pe, z, slot, 0, 4, False, zero)
        sb = _chain(qn, qp, nope, pe, z, slot, 4, 8, True, zero)
        _convert(nope, cslot, v16, cstart, hi, HALF)
        sa, sb = warpgroup_mma_wait(0, deps=(sa, sb))
        _visible()
        s = gl.convert_layout(sa + sb, MMA_S, assert_trivial=True)
        return _scores(s, start, hi, limit, row_scale, tok)

    @gluon.jit
    def _convert(nope, slot, v16, start, hi, HALF: gl.constexpr):
        """This warpgroup's half of a tile's V (latent blocks 4·HALF..4·HALF+3, fp8) → v16 [64, 256] fp16, the rows
        at or past the split end as 0 on the last tile (they hold other tokens, or whatever the page holds)."""
        keep = gl.expand_dims(start + gl.arange(0, 64, layout=gl.SliceLayout(1, CL)) < hi, 1)
        last = start + 64 > hi
        for c in gl.static_range(4):
            x = nope.index(slot).slice((4 * HALF + c) * 64, 64, dim=1).load(CL).to(gl.float16)
            if last:
                x = gl.where(keep, x, gl.zeros_like(x))
            v16.slice(c * 64, 64, dim=1).store(x)

    @gluon.jit
    def _visible():
        """This warpgroup's shared-memory stores seen by its wgmmas (fence, then a barrier of its four warps)."""
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _row_scale(qfac_smem, qk_scale):
        """Each row's score scale [64]: softmax scale · log2(e) · kv_scale (qk_scale) times its q factor."""
        return qfac_smem.load(RS) * qk_scale

    @gluon.jit
    def _left(qn, qp, nope, pe, bars, free, v16, p_smem, m0_smem, m1_smem, qfac_smem, to_right, to_left,
              SEQLENS, O, O_PART, LSE, LSE_PART, qk_scale, kv_scale, num_splits,
              stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
              stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
              Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, FINAL: gl.constexpr):
        """The left warpgroup: even tiles, output columns 0..255 and the lse (module docstring)."""
        hb, split, b, q_start, lo, hi, n_tiles, limit, row_scale, tok, m, l, o = _begin(
            SEQLENS, num_splits, qk_scale, Q_PER_SEQ, BLOCK_H)
        row_scale = _row_scale(qfac_smem, qk_scale)
        vl = v16.index(0)
        for j in range(gl.cdiv(n_tiles, 2)):
            start = lo + 2 * j * 64
            s = _tile_scores(qn, qp, nope, pe, bars, 0, j >> 24, j & 1, start, hi, limit, row_scale, tok, vl, 0,
                             start, 0)
            mbarrier.arrive(free.index(0), count=1)  # q·k of the even tile and our half of its V done
            m0, alpha, p = _online(s, m)
            l = l * alpha + gl.sum(p, 1)
            pb = p.to(gl.float16)
            o = o * gl.expand_dims(gl.convert_layout(alpha, RO), 1)
            pa = gl.convert_layout(pb, PL)
            o = warpgroup_mma(pa, vl, o, is_async=True)
            # p0 and m0 to the right warpgroup (its previous p was read before it signalled us last time)
            _send(p_smem, pb, m0_smem, m0, to_right, True)
            o, pa = warpgroup_mma_wait(0, deps=(o, pa))
            odd = start + 64 < hi  # the right warpgroup has a tile: our half of its V while it runs its softmax
            if odd:
                mbarrier.wait(bars.index(1), j & 1)
                _convert(nope, 1, vl, start + 64, hi, 0)
                _visible()
                mbarrier.arrive(free.index(1), count=1)
            mbarrier.wait(to_left, j & 1)
            m1 = m1_smem.load(RS)
            if odd:  # its p1 [64, 64] is in p_smem
                beta = _factor(m0, m1)
                l = l * beta
                o = o * gl.expand_dims(gl.convert_layout(beta, RO), 1)
                o = warpgroup_mma(p_smem, vl, o, is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
                _cta_barrier()  # every thread's p1 read done before the next p0 is stored
            m = m1
        l = _sums_left(l, m0_smem, m1_smem, to_right, to_left, n_tiles)
        _store_half(o, l, m, hb, q_start, split, O, O_PART, LSE, LSE_PART, stride_o_t, stride_o_h, stride_op_t,
                    stride_op_h, stride_op_s, stride_lse_t, stride_lse_j, stride_lse_h, stride_lp_t, stride_lp_h,
                    BLOCK_H, FINAL, 0, True, kv_scale)

    @gluon.jit
    def _right(qn, qp, nope, pe, bars, free, v16, p_smem, m0_smem, m1_smem, qfac_smem, to_right, to_left,
               kv_desc, lat_desc, BT, SEQLENS, O, O_PART, qk_scale, kv_scale, stride_bt_b, num_splits,
               stride_o_t, stride_o_h, stride_op_t, stride_op_h, stride_op_s,
               Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr, FINAL: gl.constexpr):
        """The right warpgroup: odd tiles, output columns 256..511, and the ring's refills (module docstring)."""
        BOX_BYTES: gl.constexpr = 64 * 64
        hb, split, b, q_start, lo, hi, n_tiles, limit, row_scale, tok, m, l, o = _begin(
            SEQLENS, num_splits, qk_scale, Q_PER_SEQ, BLOCK_H)
        row_scale = _row_scale(qfac_smem, qk_scale)
        vr = v16.index(1)
        bt_row = BT + b.to(gl.int64) * stride_bt_b
        for j in range(gl.cdiv(n_tiles, 2)):
            start = lo + (2 * j + 1) * 64
            has = start < hi
            # our half of the even tile's V (under our q·k when we have a tile)
            mbarrier.wait(bars.index(0), j & 1)
            if has:
                s = _tile_scores(qn, qp, nope, pe, bars, 1, j >> 24, j & 1, start, hi, limit, row_scale, tok, vr, 0,
                                 start - 64, 1)
            else:
                _convert(nope, 0, vr, start - 64, hi, 1)
                _visible()
                s = gl.full([64, 64], float("-inf"), gl.float32, layout=MMA_S)
            mbarrier.arrive(free.index(0), count=1)
            # the left's p0 and m0, p0·V0_R issued before our softmax; our p1 and m1 to the left
            m1, beta, p1b, l, o = _right_exchange(s, vr, p_smem, m0_smem, m1_smem, to_right, to_left, j & 1, m, l, o,
                                                  has)
            # tile 2j + 2 into the even slot once both warpgroups are done with tile 2j
            nxt = lo + (2 * j + 2) * 64
            _refill(kv_desc, lat_desc, nope, pe, bars, free, 0, j & 1, bt_row, nxt, nxt < hi, PAGE, BOX_BYTES)
            o = o * gl.expand_dims(gl.convert_layout(beta, RO), 1)
            if has:
                _convert(nope, 1, vr, start, hi, 1)
                _visible()
                mbarrier.arrive(free.index(1), count=1)
                pa = gl.convert_layout(p1b, PL)
                o = warpgroup_mma(pa, vr, o, is_async=True)
                o, pa = warpgroup_mma_wait(0, deps=(o, pa))
                nxt = nxt + 64
                if nxt < hi:  # tile 2j + 3 into the odd slot once both are done with tile 2j + 1
                    _refill(kv_desc, lat_desc, nope, pe, bars, free, 1, j & 1, bt_row, nxt, True, PAGE, BOX_BYTES)
            m = m1
        l = _sums_right(l, m0_smem, m1_smem, to_right, to_left, n_tiles)
        _store_half(o, l, m, hb, q_start, split, O, O_PART, O, O, stride_o_t, stride_o_h, stride_op_t,
                    stride_op_h, stride_op_s, 0, 0, 0, 0, 0, BLOCK_H, FINAL, 256, False, kv_scale)

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_seesaw_fp8_decode(Q, kv_desc, lat_desc, BT, SEQLENS, O, LSE, O_PART, LSE_PART, qk_scale, kv_scale,
                               KV_SCALE_PTR, stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h,
                               stride_lse_t, stride_lse_j, stride_lse_h,
                               stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
                               num_splits,
                               Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr,
                               FINAL: gl.constexpr, SCALE_FROM_PTR: gl.constexpr):
        """Grid (head blocks, splits, batch), two warpgroups; program row r: query token r // BLOCK_H of the
        sequence, head hb·BLOCK_H + r % BLOCK_H. qk_scale: softmax scale · log2(e); kv_scale the pool's (or read
        from KV_SCALE_PTR). Module docstring for the rest."""
        BOX_BYTES: gl.constexpr = 64 * 64
        hb, split, b, q_start, prefix, lo, hi = _program_span(SEQLENS, num_splits, Q_PER_SEQ)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        bt_row = BT + b.to(gl.int64) * stride_bt_b
        if SCALE_FROM_PTR:
            kv_scale = gl.load(KV_SCALE_PTR).to(gl.float32)

        # a slot goes back to the TMA once both warpgroups are done with it (two arrivals)
        nope, pe, bars, free, to_right, to_left = _ring(kv_desc, lat_desc, bt_row, lo, n_tiles, gl.float8e4nv, 2,
                                                        PAGE, BOX_BYTES)

        # q [64 rows, 576] as its two e4m3 parts, each row scaled by a power of two into (128, 256]
        qn = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 512], _Q8)
        qp = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 64], _Q8)
        v16 = gl.allocate_shared_memory(gl.float16, [2, 64, 256], _TILE16)
        p_smem = gl.allocate_shared_memory(gl.float16, [64, 64], _TILE16)
        m0_smem = gl.allocate_shared_memory(gl.float32, [64], _VEC)
        m1_smem = gl.allocate_shared_memory(gl.float32, [64], _VEC)
        qfac_smem = gl.allocate_shared_memory(gl.float32, [64], _VEC)
        q_row, qc = _q_rows(Q, hb, q_start, stride_q_t, stride_q_h, BLOCK_H)
        amax = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, QL))
        for c in gl.static_range(9):
            amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_row + c * 64 + qc).to(gl.float32)), 1))
        qfac = gl.exp2(gl.ceil(gl.log2(gl.maximum(amax, 1e-30) * (1.0 / 256.0))))
        inv_f = gl.expand_dims(1.0 / qfac, 1)
        for c in gl.static_range(9):
            x = gl.load(q_row + c * 64 + qc).to(gl.float32) * inv_f
            hi_part = _e4m3_value(x)
            if c < 8:
                qn.index(1).slice(c * 64, 64, dim=1).store(hi_part.to(gl.float8e4nv))
                qn.index(0).slice(c * 64, 64, dim=1).store((x - hi_part).to(gl.float8e4nv))
            else:
                qp.index(1).store(hi_part.to(gl.float8e4nv))
                qp.index(0).store((x - hi_part).to(gl.float8e4nv))
        qfac_smem.store(qfac * kv_scale)
        fence_async_shared()
        _cta_barrier()

        gl.warp_specialize([
            (_left, (qn, qp, nope, pe, bars, free, v16, p_smem, m0_smem, m1_smem, qfac_smem, to_right, to_left,
                     SEQLENS, O, O_PART, LSE, LSE_PART, qk_scale, kv_scale, num_splits,
                     stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
                     stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h, Q_PER_SEQ, BLOCK_H, FINAL)),
            (_right, (qn, qp, nope, pe, bars, free, v16, p_smem, m0_smem, m1_smem, qfac_smem, to_right, to_left,
                      kv_desc, lat_desc, BT, SEQLENS, O, O_PART, qk_scale, kv_scale, stride_bt_b, num_splits,
                      stride_o_t, stride_o_h, stride_op_t, stride_op_h, stride_op_s,
                      Q_PER_SEQ, BLOCK_H, PAGE, FINAL)),
        ], [WARPS], [RIGHT_REGS_FP8])
