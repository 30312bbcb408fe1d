"""MLA decode for Hopper (sm90) in Gluon over a bf16/fp16 paged cache, 64 query rows per program, the two
warpgroups on alternate tiles ("seesaw") — the wide kernel's (gluon_mla_wide) problem, scheduled differently.

Why: in the wide kernel both warpgroups compute q·k of the same tile, 32 tokens each, so each reads all of q
(72 KB) from shared memory per tile, and the softmax exchanges its row max and p between them through shared
memory behind CTA barriers. Here the left warpgroup (the default partition) takes the even tiles and the right one
(a worker partition, `gl.warp_specialize`) the odd tiles, each computing q·k over its whole tile (q read once per
tile), and each owns half of the output columns (o [64, 256] fp32, 128 registers a thread):

- left, tile 2j:   s0 = q·K0^T;  m0 = max(m, rowmax s0);  p0 = exp2(s0 - m0);  o_L = o_L·2^(m - m0) + p0·V0[:, :256];
  p0 and m0 go to shared memory (one mbarrier);
- right, tile 2j+1: s1 = q·K1^T;  once the left's p0 is there, o_R = o_R·2^(m - m0) + p0·V0[:, 256:] is issued
  first (so that the even slot goes back to the TMA early), then under it m1 = max(m0, rowmax s1), b = 2^(m0 - m1),
  p1 = exp2(s1 - m1); p1 and m1 go to shared memory (one mbarrier); o_R = o_R·b + p1·V1[:, 256:];
- left: o_L = o_L·b + p1·V1[:, :256] (p1 read by the wgmma from shared memory); both now hold m = m1.

While one warpgroup runs its softmax the other keeps the tensor cores busy. The row sums are kept per warpgroup
over its own tiles (rescaled with the same factors) and added once at the end. The tiles come by TMA (latent as
one [8, 64, 64] box and the rope block, as in the wide kernel's default) into a ring of two slots, slot 0 for even
tiles and slot 1 for odd ones; the right warpgroup refills a slot once the left one has released it (one mbarrier
per slot) and its own last read of it is done. Rows of the last tile past the split end are masked in the scores
and their V rows zeroed in shared memory by the tile's owner before either warpgroup's p·v reads them. Shared
memory: q 72 KB, two tiles 144 KB, p 8 KB, row maxima 0.5 KB (225 of the 227 KiB an sm90 program may have).

On an H200 at 128 heads, bf16 (bench/results/NVIDIA_H200/attention/2026-12-02_seesaw): B=128 at 8k 0.612 →
0.516 ms (477 → 566 TFLOPS), at 16k 1.31 → 1.08 ms, B=64 at 8k 0.310 → 0.258 ms, S_q 2 1.26 → 1.03 ms; equal at
batch 8 and within 2 % at batch 1 with 64 splits (a lone sequence now gets at most 32: gluon_mla_wide.split_cap).
Tried and dropped: an L2 prefetch of the tiles one or two pairs ahead (one bulk prefetch per tile, 9–12 % slower at
B=128 8k).

The result and lse, or per-split fp32 partials for triton_kernels' `_mla_combine` (the output contract of the
wide kernel). bf16/fp16 pools only: over an fp8 pool each warpgroup would need a 16-bit copy of its tile for its
MMAs, and two of them (144 KB) do not fit beside q and the byte ring; gluon_mla_seesaw_fp8 runs this schedule there
with q·k in e4m3 and half a tile of V converted per warpgroup, sharing this module's partition helpers.
"""

from __future__ import annotations

from pdlab.attention import gluon_mla_wide as W

if W.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from pdlab.attention.gluon_mla import _out_rows, _program_span
    from pdlab.attention.gluon_mla_wide import _TILE16, _cta_barrier, _issue, _scores, _store_lse, _zero_tail

    WARPS = gl.constexpr(4)  # the launch's num_warps: the left warpgroup; warp_specialize adds the right one (8 warps)
    # the right warpgroup's registers a thread (the left one gets the rest of the SM's 64 K)
    RIGHT_REGS = gl.constexpr(240)
    _VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    # one warpgroup's q·k accumulator [64, 64], p·v accumulator [64, 256], p as p·v's register operand, row layouts
    MMA_S = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    MMA_O = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    PL = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA_O.value, k_width=2))
    RS = gl.constexpr(gl.SliceLayout(1, MMA_S.value))
    RO = gl.constexpr(gl.SliceLayout(1, MMA_O.value))
    ZL = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))  # zeroing a tile's [64, 64] V blocks
    QL = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # q's [64, 64] blocks from global memory

    @gluon.jit
    def _tile_scores(qn, qp, nope, pe, bars, slot, z, phase, start, hi, limit, row_scale, tok):
        """The masked, scaled scores [64, 64] (base 2) of the tile at `start` in ring slot `slot` once it has
        landed; on the last tile of the split, its V rows past the end zeroed for both warpgroups' p·v. z: the pair
        index >> 24, 0 for any int32 length (pairs of 128 tokens) but not known to the compiler to be, so that the
        72 shared-memory descriptors of q·k's wgmmas are computed where they are used instead of held in registers
        across the loop (ptxas spilled them)."""
        mbarrier.wait(bars.index(slot), phase)
        s = warpgroup_mma(qn.index(z), nope.index(slot + z).permute((1, 0)),
                          gl.zeros([64, 64], gl.float32, layout=MMA_S), use_acc=False, is_async=True)
        s = warpgroup_mma(qp.index(z), pe.index(slot + z).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        if start + 64 > hi:
            _zero_tail(nope.index(slot), hi - start, ZL)
            fence_async_shared()
            _cta_barrier()
        return _scores(s, start, hi, limit, row_scale, tok)

    @gluon.jit
    def _begin(SEQLENS, num_splits, qk_scale, Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr):
        """A warpgroup's start: (head block, split, sequence b, first query token, [lo, hi), tiles of the split,
        limit — row r sees positions < limit[r] —, the rows' score scale, a tile's token offsets, and the running
        max m, row sums l and output half o [64, 256] fp32 before the first tile)."""
        hb, split, b, q_start, prefix, lo, hi = _program_span(SEQLENS, num_splits, Q_PER_SEQ)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        limit = prefix + gl.arange(0, 64, layout=RS) // BLOCK_H + 1
        row_scale = gl.full([64], qk_scale, gl.float32, layout=RS)
        tok = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA_S))
        m = gl.full([64], float("-inf"), gl.float32, layout=RS)
        l = gl.zeros([64], gl.float32, layout=RS)
        o = gl.zeros([64, 256], gl.float32, layout=MMA_O)
        return hb, split, b, q_start, lo, hi, n_tiles, limit, row_scale, tok, m, l, o

    @gluon.jit
    def _factor(m_prev, m_new):
        """2^(m_prev − m_new) [64]: what brings sums taken at row max m_prev to m_new ≥ m_prev (base 2); 1 where
        m_prev is -inf (nothing summed yet)."""
        return gl.where(m_prev == float("-inf"), 1.0, gl.exp2(m_prev - gl.where(m_new == float("-inf"), 0.0, m_new)))

    @gluon.jit
    def _online(s, m_prev):
        """One softmax step over scores s [64, 64] (base 2) against the running max m_prev [64]: (the new max,
        `_factor` from m_prev to it, p = 2^(s − new max))."""
        m_new = gl.maximum(m_prev, gl.max(s, 1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, _factor(m_prev, m_new), gl.exp2(s - gl.expand_dims(m_base, 1))

    @gluon.jit
    def _send(p_smem, p, m_smem, m, bar, with_p):
        """p [64, 64] (where with_p) and the row max m [64] to the other warpgroup: stored, made visible to its loads
        and wgmmas, one arrival on `bar`."""
        if with_p:
            p_smem.store(p)
        m_smem.store(m)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _q_rows(Q, hb, q_start, stride_q_t, stride_q_h, BLOCK_H: gl.constexpr):
        """Pointers to the program's 64 query rows [64, 1] (row r: query token r // BLOCK_H, head hb·BLOCK_H +
        r % BLOCK_H) and a 64-column block's offsets [1, 64], in QL."""
        qr = gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
        qh = hb * BLOCK_H + qr % BLOCK_H
        q_row = Q + gl.expand_dims((q_start + qr // BLOCK_H).to(gl.int64) * stride_q_t + qh * stride_q_h, 1)
        return q_row, gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)

    @gluon.jit
    def _ring(kv_desc, lat_desc, bt_row, lo, n_tiles, dtype: gl.constexpr, FREE_COUNT: gl.constexpr,
              PAGE: gl.constexpr, BOX_BYTES: gl.constexpr):
        """The TMA ring of two tiles (latent [2, 64, 512] and rope [2, 64, 64] of `dtype` in the pool's box layout)
        with the first two tiles of [lo, ...) in flight, and the mbarriers: a tile landed (per slot), a slot released
        (per slot, FREE_COUNT arrivals), p and m to the right warpgroup, to the left one. Returns (latent, rope,
        landed, released, to_right, to_left)."""
        nope = gl.allocate_shared_memory(dtype, [2, 64, 512], kv_desc.layout)
        pe = gl.allocate_shared_memory(dtype, [2, 64, 64], kv_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        to_right = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        to_left = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bars.index(i), count=1)
            mbarrier.init(free.index(i), count=FREE_COUNT)
        mbarrier.init(to_right, count=1)
        mbarrier.init(to_left, count=1)
        for i in gl.static_range(2):
            start = lo + i * 64
            ok = i < n_tiles
            page = gl.load(bt_row + start // PAGE, mask=ok, other=0)
            _issue(kv_desc, lat_desc, nope, pe, bars, i, page, start, ok, PAGE, BOX_BYTES, True)
        return nope, pe, bars, free, to_right, to_left

    @gluon.jit
    def _right_exchange(s, v0, p_smem, m0_smem, m1_smem, to_right, to_left, phase, m, l, o, has):
        """The right warpgroup's half of a pair's exchange, its scores s [64, 64] (base 2) in hand: once the left's
        p0 and m0 are there (`to_right` completes `phase`), o [64, 256] and l rescaled from m to m0 and p0·v0 issued
        (v0: its columns of the even tile's V in shared memory) before its own softmax against m0; p1 (where `has`)
        and m1 then go to the left. Returns (m1, 2^(m0 − m1) [64], p1 in p_smem's dtype, l with p1's sums, o with
        p0·v0 added)."""
        mbarrier.wait(to_right, phase)
        m0 = m0_smem.load(RS)
        alpha = _factor(m, m0)
        p0 = gl.convert_layout(p_smem.load(MMA_S), PL)
        l = l * alpha
        o = o * gl.expand_dims(gl.convert_layout(alpha, RO), 1)
        o = warpgroup_mma(p0, v0, o, is_async=True)
        m1, beta, p1 = _online(s, m0)
        l = l * beta + gl.sum(p1, 1)
        p1b = p1.to(p_smem.dtype)
        _cta_barrier()  # every thread's p0 read done before p1 is stored over it
        _send(p_smem, p1b, m1_smem, m1, to_left, has)
        o, p0 = warpgroup_mma_wait(0, deps=(o, p0))
        return m1, beta, p1b, l, o

    @gluon.jit
    def _refill(kv_desc, lat_desc, nope, pe, bars, free, slot, phase, bt_row, nxt, pred, PAGE: gl.constexpr,
                BOX_BYTES: gl.constexpr):
        """The tile at `nxt` (where pred) into ring slot `slot` once both warpgroups released it (`free` completes
        `phase`)."""
        mbarrier.wait(free.index(slot), phase)
        page = gl.load(bt_row + nxt // PAGE, mask=pred, other=0)
        _issue(kv_desc, lat_desc, nope, pe, bars, slot, page, nxt, pred, PAGE, BOX_BYTES, True)

    @gluon.jit
    def _sums_left(l, m0_smem, m1_smem, to_right, to_left, n_tiles):
        """The left warpgroup's row sums [64] plus the right's: ours sent first, theirs back."""
        m0_smem.store(l)
        _cta_barrier()
        mbarrier.arrive(to_right, count=1)
        mbarrier.wait(to_left, gl.cdiv(n_tiles, 2) & 1)
        return l + m1_smem.load(RS)

    @gluon.jit
    def _sums_right(l, m0_smem, m1_smem, to_right, to_left, n_tiles):
        """The right warpgroup's row sums [64] plus the left's: theirs received, then ours sent."""
        mbarrier.wait(to_right, gl.cdiv(n_tiles, 2) & 1)
        l_left = m0_smem.load(RS)
        m1_smem.store(l)
        _cta_barrier()
        mbarrier.arrive(to_left, count=1)
        return l + l_left

    @gluon.jit
    def _store_half(o, l, m, hb, q_start, split, O, O_PART, LSE, LSE_PART, stride_o_t, stride_o_h, stride_op_t,
                    stride_op_h, stride_op_s, stride_lse_t, stride_lse_j, stride_lse_h, stride_lp_t, stride_lp_h,
                    BLOCK_H: gl.constexpr, FINAL: gl.constexpr, COL: gl.constexpr, WITH_LSE: gl.constexpr,
                    scale=1.0):
        """Write o [64, 256] · scale / l into output columns COL..COL+255 (and, WITH_LSE, the rows' lse); scale:
        an fp8 pool's kv_scale."""
        empty = l == 0.0
        inv = gl.convert_layout(scale / gl.where(empty, 1.0, l), RO)
        o = o * gl.expand_dims(inv, 1)
        out_rows, _, _ = _out_rows(gl.arange(0, 64, layout=RO), hb, q_start, split, O, O_PART, stride_o_t,
                                   stride_o_h, stride_op_t, stride_op_h, stride_op_s, BLOCK_H, FINAL)
        dcol = COL + gl.arange(0, 256, layout=gl.SliceLayout(0, MMA_O))
        gl.store(gl.expand_dims(out_rows, 1) + gl.expand_dims(dcol, 0), o.to(out_rows.dtype.element_ty))
        if WITH_LSE:
            lse = gl.where(empty, float("-inf"), (m + gl.log2(gl.where(empty, 1.0, l))) * 0.6931471805599453)
            _store_lse(lse, gl.arange(0, 64, layout=RS), hb, q_start, split, LSE, LSE_PART, stride_lse_t,
                       stride_lse_j, stride_lse_h, stride_lp_t, stride_lp_h, BLOCK_H, FINAL)

    @gluon.jit
    def _left(qn, qp, nope, pe, bars, free, p_smem, m0_smem, m1_smem, to_right, to_left,
              SEQLENS, O, O_PART, LSE, LSE_PART, qk_scale, num_splits,
              stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
              stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
              Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, FINAL: gl.constexpr):
        """The left warpgroup: even tiles, output columns 0..255 and the lse (module docstring)."""
        hb, split, b, q_start, lo, hi, n_tiles, limit, row_scale, tok, m, l, o = _begin(
            SEQLENS, num_splits, qk_scale, Q_PER_SEQ, BLOCK_H)
        for j in range(gl.cdiv(n_tiles, 2)):
            start = lo + 2 * j * 64
            s = _tile_scores(qn, qp, nope, pe, bars, 0, j >> 24, j & 1, start, hi, limit, row_scale, tok)
            m0, alpha, p = _online(s, m)
            l = l * alpha + gl.sum(p, 1)
            pb = p.to(qn.dtype)
            o = o * gl.expand_dims(gl.convert_layout(alpha, RO), 1)
            pa = gl.convert_layout(pb, PL)
            o = warpgroup_mma(pa, nope.index(0).slice(0, 256, dim=1), o, is_async=True)
            # p0 and m0 to the right warpgroup (its previous p was read before it signalled us last time)
            _send(p_smem, pb, m0_smem, m0, to_right, True)
            o, pa = warpgroup_mma_wait(0, deps=(o, pa))
            mbarrier.arrive(free.index(0), count=1)  # done with the even tile
            mbarrier.wait(to_left, j & 1)
            m1 = m1_smem.load(RS)
            if start + 64 < hi:  # the right warpgroup had a tile: its p1 [64, 64] is in p_smem
                beta = _factor(m0, m1)
                l = l * beta
                o = o * gl.expand_dims(gl.convert_layout(beta, RO), 1)
                o = warpgroup_mma(p_smem, nope.index(1).slice(0, 256, dim=1), o, is_async=True)
                o = warpgroup_mma_wait(0, deps=(o,))
                _cta_barrier()  # every thread's p1 read done before the next p0 is stored
                mbarrier.arrive(free.index(1), count=1)
            m = m1
        l = _sums_left(l, m0_smem, m1_smem, to_right, to_left, n_tiles)
        _store_half(o, l, m, hb, q_start, split, O, O_PART, LSE, LSE_PART, stride_o_t, stride_o_h, stride_op_t,
                    stride_op_h, stride_op_s, stride_lse_t, stride_lse_j, stride_lse_h, stride_lp_t, stride_lp_h,
                    BLOCK_H, FINAL, 0, True)

    @gluon.jit
    def _right(qn, qp, nope, pe, bars, free, p_smem, m0_smem, m1_smem, to_right, to_left,
               kv_desc, lat_desc, BT, SEQLENS, O, O_PART, qk_scale, stride_bt_b, num_splits,
               stride_o_t, stride_o_h, stride_op_t, stride_op_h, stride_op_s,
               Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr, FINAL: gl.constexpr):
        """The right warpgroup: odd tiles, output columns 256..511, and the ring's refills (module docstring)."""
        BOX_BYTES: gl.constexpr = 64 * 64 * 2
        hb, split, b, q_start, lo, hi, n_tiles, limit, row_scale, tok, m, l, o = _begin(
            SEQLENS, num_splits, qk_scale, Q_PER_SEQ, BLOCK_H)
        bt_row = BT + b.to(gl.int64) * stride_bt_b
        for j in range(gl.cdiv(n_tiles, 2)):
            start = lo + (2 * j + 1) * 64
            has = start < hi
            if has:
                s = _tile_scores(qn, qp, nope, pe, bars, 1, j >> 24, j & 1, start, hi, limit, row_scale, tok)
            else:
                s = gl.full([64, 64], float("-inf"), gl.float32, layout=MMA_S)
            # the left's p0 and m0, p0·V0[:, 256:] issued before our softmax so that the even slot goes back to the
            # TMA early; our p1 and m1 to the left
            m1, beta, p1b, l, o = _right_exchange(s, nope.index(0).slice(256, 256, dim=1), p_smem, m0_smem, m1_smem,
                                                  to_right, to_left, j & 1, m, l, o, has)
            # tile 2j + 2 into the even slot once the left warpgroup is done with tile 2j too
            nxt = lo + (2 * j + 2) * 64
            _refill(kv_desc, lat_desc, nope, pe, bars, free, 0, j & 1, bt_row, nxt, nxt < hi, PAGE, BOX_BYTES)
            o = o * gl.expand_dims(gl.convert_layout(beta, RO), 1)
            if has:
                pa = gl.convert_layout(p1b, PL)
                o = warpgroup_mma(pa, nope.index(1).slice(256, 256, dim=1), o, is_async=True)
                o, pa = warpgroup_mma_wait(0, deps=(o, pa))
                nxt = nxt + 64
                if nxt < hi:  # tile 2j + 3 into the odd slot once the left warpgroup is done with tile 2j + 1
                    _refill(kv_desc, lat_desc, nope, pe, bars, free, 1, j & 1, bt_row, nxt, True, PAGE, BOX_BYTES)
            m = m1
        l = _sums_right(l, m0_smem, m1_smem, to_right, to_left, n_tiles)
        _store_half(o, l, m, hb, q_start, split, O, O_PART, O, O, stride_o_t, stride_o_h, stride_op_t,
                    stride_op_h, stride_op_s, 0, 0, 0, 0, 0, BLOCK_H, FINAL, 256, False)

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_seesaw_decode(Q, kv_desc, lat_desc, BT, SEQLENS, O, LSE, O_PART, LSE_PART, qk_scale,
                           stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h,
                           stride_lse_t, stride_lse_j, stride_lse_h,
                           stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
                           num_splits,
                           Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr,
                           FINAL: gl.constexpr):
        """Grid (head blocks, splits, batch), two warpgroups; program row r: query token r // BLOCK_H of the
        sequence, head hb·BLOCK_H + r % BLOCK_H. Module docstring for the rest."""
        dt: gl.constexpr = kv_desc.dtype
        BOX_BYTES: gl.constexpr = 64 * 64 * 2
        hb, split, b, q_start, prefix, lo, hi = _program_span(SEQLENS, num_splits, Q_PER_SEQ)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        bt_row = BT + b.to(gl.int64) * stride_bt_b

        nope, pe, bars, free, to_right, to_left = _ring(kv_desc, lat_desc, bt_row, lo, n_tiles, dt, 1, PAGE,
                                                        BOX_BYTES)

        qn = gl.allocate_shared_memory(dt, [1, 64, 512], _TILE16)
        qp = gl.allocate_shared_memory(dt, [1, 64, 64], _TILE16)
        p_smem = gl.allocate_shared_memory(dt, [64, 64], _TILE16)
        m0_smem = gl.allocate_shared_memory(gl.float32, [64], _VEC)
        m1_smem = gl.allocate_shared_memory(gl.float32, [64], _VEC)
        q_row, qc = _q_rows(Q, hb, q_start, stride_q_t, stride_q_h, BLOCK_H)
        for c in gl.static_range(8):
            qn.index(0).slice(c * 64, 64, dim=1).store(gl.load(q_row + c * 64 + qc))
        qp.index(0).store(gl.load(q_row + 512 + qc))
        fence_async_shared()
        _cta_barrier()

        gl.warp_specialize([
            (_left, (qn, qp, nope, pe, bars, free, p_smem, m0_smem, m1_smem, to_right, to_left,
                     SEQLENS, O, O_PART, LSE, LSE_PART, qk_scale, num_splits,
                     stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
                     stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h, Q_PER_SEQ, BLOCK_H, FINAL)),
            (_right, (qn, qp, nope, pe, bars, free, p_smem, m0_smem, m1_smem, to_right, to_left,
                      kv_desc, lat_desc, BT, SEQLENS, O, O_PART, qk_scale, stride_bt_b, num_splits,
                      stride_o_t, stride_o_h, stride_op_t, stride_op_h, stride_op_s,
                      Q_PER_SEQ, BLOCK_H, PAGE, FINAL)),
        ], [WARPS], [RIGHT_REGS])
