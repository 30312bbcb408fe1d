"""MLA decode for Hopper (sm90) in Gluon over a paged cache (bf16 / fp16, or fp8 e4m3 bytes), 64 query rows per
program — the compute-bound case (128 heads: DeepSeek with data-parallel attention).

Why: `_mla_fwd` of triton_kernels.py runs a 64-head program as one chain — tile loads, q·k, softmax, p·v — with
the tensor cores idle whenever the softmax or a load is on the critical path (one 8-warp program per SM, 253
TFLOPS at B=128, 8k on an H200). Here one program (two warpgroups, one per SM) holds 64 query rows of one
sequence (heads × S_q = 64: 64 heads of one query token, 32 of two, 16 of four) and walks one split of its KV
range in tiles of 64 tokens:

- The tiles stream in by TMA (one mbarrier per tile) into a ring of STAGES = 2 buffers [64 tokens, 576] in the
  128-byte swizzle that wgmma reads (eight [64, 64] latent panels one after the other, and the rope block); q
  [64, 576] sits beside them in the same layout (72 KB each: 216 KB of the SM's 227). The cache is addressed as one
  [pages · page, 576] tensor, so a tile lies in one page (page size 64 or 128): the tile's TMA row is
  page_id · page + offset; the page ids are read a tile before they are needed. The latent comes as one
  [8, 64, 64] box of the pool seen as [8, P·page, 64] (TMA3, the default; it lands as the eight panels) and the
  rope block as one [64, 64] box: Triton adds a CTA barrier after each TMA copy, so nine boxes cost a tile 11
  barriers and two boxes 4, which made the kernel 4–16 % faster at 128 heads on an H200
  (bench/results/NVIDIA_H200/attention/2026-12-02_tma3).
- s [64 rows, 64 tokens] = q · K^T is one wgmma chain (K = 576) with both operands in shared memory; the two
  warpgroups take 32 tokens each. Online softmax in base 2; the row max is exchanged between the warpgroups
  (the only cross-warpgroup reduction per tile; the row sums are accumulated per thread and reduced once at the
  end).
- o [64, 512] += p · V: p (bf16/fp16, registers) is the A operand, V the first 512 columns of the same tile read
  in place (B, N-major); each warpgroup owns 256 output columns (128 fp32 registers per thread).
- A tile's buffer goes back to the TMA once both warpgroups are done with it: the load of tile i + 2 runs while
  tile i + 1 is computed. (Issuing q·k of tile i + 1 before p·v of tile i, so that the softmax overlaps p·v, was
  measured 10–20 % slower: with two buffers the next load then has no time to land.)
- Rows of the last tile past the split end hold other tokens or, past the sequence, whatever the page holds (NaN
  in the tests): their scores are masked and their V rows zeroed in shared memory before p·v, so nothing read
  past a length reaches the output. Pages past a sequence's length are never read.
- fp8 pools: the ring holds the e4m3 bytes (36 KB a tile) and one fp16 tile [64, 576] the MMAs read. Each tile is
  converted (one `cvt.rn.f16x2.e4m3x2` per two values) in groups of CONV_GROUP of its nine 64-column blocks, each
  group made visible to wgmma by one fence and one barrier, a group's q·k wgmmas in flight while the next group is
  converted; its ring slot then goes back to the TMA (the last tile's V rows past the split end are zeroed in the
  fp16 tile, as in the 16-bit path). The default converts the whole tile behind one barrier (9): on an H200 at
  128 heads 4–6 % faster than one block per barrier (B=128, 8k: 0.90 → 0.85 ms), 1 % at B=8, 3 in between
  (bench/results/NVIDIA_H200/attention/2026-12-02_conv_group). q is
  stored in fp16 divided per row by a power of two that keeps it below 2^14 (exact; no fp16 overflow), the factor
  and the pool's scale folded into the scores, the scale into the output.

The result and lse, or per-split fp32 partials for triton_kernels' `_mla_combine` (the output contract of
`_mla_fwd` and of gluon_mla).

With `seesaw` (the default) `launch` runs a two-warpgroup kernel instead: gluon_mla_seesaw over bf16/fp16 pools
(the same problem with the warpgroups on alternate tiles, 1.12–1.23× faster from batch 32 on an H200), and
gluon_mla_seesaw_fp8 over fp8 pools with bf16 queries (1.05–1.15× from 48 tiles a split) where the caller chose it
(triton_kernels `_gluon_kernel`: a split of more than SEESAW_FP8_MIN_TILES tiles). This kernel keeps the shorter fp8
splits, fp16 queries over fp8 and `seesaw=0`.
"""

from __future__ import annotations

import functools

import torch

from pdlab.attention.backends.triton_mla import DECODE_DEFAULT
from pdlab.kernels.arch import SM90

try:  # Gluon (Triton ≥ 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - reported by `available()`
    HAVE_GLUON = False

ROWS = 64  # query rows per program: the wgmma M of both warpgroups
BLOCK_N = 64  # tokens per tile
STAGES = 2  # tiles in the TMA ring (q + 2 tiles = 216 KB of shared memory)
PAGES = (64, 128)  # page sizes whose pages hold whole tiles
WARPS = 8
CONV_GROUPS = (1, 3, 9)  # fp8 pools: column blocks of a tile converted between two barriers (nine blocks a tile)
# the triton decode backend's defaults: fp8 tiles converted whole (9), a tile's latent as one [8, 64, 64] TMA box
CONV_GROUP = int(DECODE_DEFAULT["conv_group"])
TMA3 = bool(DECODE_DEFAULT["tma3"])
SEESAW = bool(DECODE_DEFAULT["seesaw"])  # 16-bit pools: the warpgroups on alternate tiles (gluon_mla_seesaw)


def available(device: torch.device, q_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when the kernel can run on `device` for queries of `q_dtype`, else why not: the fp8 Gluon kernel's
    conditions (a Triton with Gluon, an sm90 GPU, no interpreter) and its TMA API, 16-bit queries."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon with Hopper TMA (triton.experimental.gluon)"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"{q_dtype} queries: the kernel computes in 16 bits (bf16 or fp16 queries)"
    from pdlab.attention import gluon_mla

    return gluon_mla.available(device, q_dtype)


def unfit(heads: int, q_len: int, kv_dtype: torch.dtype, q_dtype: torch.dtype, page: int) -> str | None:
    """None when the kernel takes this problem — decode over a pool of page 64 or 128, bf16/fp16 with queries of
    its dtype or fp8 (uint8 e4m3 bytes) with bf16/fp16 queries, heads × q_len a multiple of 64 rows with whole
    heads per program — else why not. What the launcher's "auto" and the tuner's search space both follow."""
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.uint8):
        return f"{kv_dtype} pools: the kernel reads bf16, fp16 or fp8 (uint8 e4m3) pools"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"{q_dtype} queries: the kernel computes in 16 bits (bf16 or fp16 queries)"
    if kv_dtype != torch.uint8 and q_dtype != kv_dtype:
        return f"{q_dtype} queries over a {kv_dtype} pool (the MMAs take one 16-bit type)"
    if q_len <= 0 or q_len > ROWS or ROWS % q_len:
        return f"S_q {q_len}: a program holds {ROWS} rows of whole query tokens"
    if heads % (ROWS // q_len):
        return f"{heads} heads × S_q {q_len} do not split into programs of {ROWS} rows"
    if page not in PAGES:
        return f"page size {page}: tiles of {BLOCK_N} tokens are read by TMA from one page (page 64 or 128)"
    return None


if HAVE_GLUON:
    from pdlab.attention.gluon_mla import _out_rows, _program_span, _to_f16

    _STAGES = gl.constexpr(STAGES)
    _TILE16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # public from Triton 3.7 on
        @gluon.jit
        def _as_panels(buf, layout: gl.constexpr):
            """A ring slot's [64, 512] latent as its eight [64, 64] panels, [8, 64, 64] (the same bytes)."""
            return buf.reinterpret(buf.dtype, [8, 64, 64], layout)
    else:
        @gluon.jit
        def _as_panels(buf, layout: gl.constexpr):
            """A ring slot's [64, 512] latent as its eight [64, 64] panels, [8, 64, 64] (the same bytes)."""
            return buf._reinterpret(buf.dtype, [8, 64, 64], layout)

    @gluon.jit
    def _issue(kv_desc, lat_desc, nope, pe, bars, slot, page, start, pred, PAGE: gl.constexpr,
               BOX_BYTES: gl.constexpr, TMA3: gl.constexpr):
        """TMA of the tile at `start` (in page `page`) into ring slot `slot`, one mbarrier: the latent as eight
        [64, 64] boxes, or (TMA3) as one [8, 64, 64] box of `lat_desc` (the same bytes: the slot's eight 64-column
        panels lie one after the other), then the rope block."""
        bar = bars.index(slot)
        row = page * PAGE + start % PAGE
        mbarrier.expect(bar, 9 * BOX_BYTES, pred=pred)
        if TMA3:
            panels = _as_panels(nope.index(slot), gl.constexpr(lat_desc.layout))
            _tma_load(lat_desc, [0, row, 0], bar, panels, pred=pred)
        else:
            for c in gl.static_range(8):
                _tma_load(kv_desc, [row, c * 64], bar, nope.index(slot).slice(c * 64, 64, dim=1), pred=pred)
        _tma_load(kv_desc, [row, 512], bar, pe.index(slot), pred=pred)

    @gluon.jit
    def _zero_tail(tile, valid, ZL: gl.constexpr):
        """Zero the rows ≥ `valid` of a tile's V [64, 512] in shared memory (eight [64, 64] column blocks)."""
        keep = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, ZL)) < valid, 1)
        for c in gl.static_range(8):
            blk = tile.slice(c * 64, 64, dim=1)
            x = blk.load(ZL)
            blk.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _block(nope, pe, c: gl.constexpr):
        """Column block c of a tile: the latent's [64, 64] block c < 8, the rope block for c = 8."""
        if c < 8:
            return nope.slice(c * 64, 64, dim=1)
        else:
            return pe

    @gluon.jit
    def _qk_fp8(qn_smem, qp_smem, nope8, pe8, nope16, pe16, s_zero, CL: gl.constexpr, GROUP: gl.constexpr):
        """Issue s = q · K^T of an fp8 tile, converting it into the fp16 tile GROUP column blocks (of nine: eight
        latent, one rope) at a time, each group made visible to wgmma by one fence and one barrier: a group's
        wgmmas are in flight while the next group is converted."""
        s = s_zero
        for g in gl.static_range(9 // GROUP):
            for c in gl.static_range(g * GROUP, (g + 1) * GROUP):
                _block(nope16, pe16, c).store(_to_f16(_block(nope8, pe8, c).load(CL)))
            fence_async_shared()
            _cta_barrier()
            for c in gl.static_range(g * GROUP, (g + 1) * GROUP):
                if c < 8:
                    s = warpgroup_mma(qn_smem.slice(c * 64, 64, dim=1), nope16.slice(c * 64, 64, dim=1).permute((1, 0)),
                                      s, use_acc=c > 0, is_async=True)
                else:
                    s = warpgroup_mma(qp_smem, pe16.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _qk(qn_smem, qp_smem, k_nope, k_pe, s_zero):
        """Issue s = q · K^T of one tile (latent and rope columns, one chain of 36 wgmmas)."""
        s = warpgroup_mma(qn_smem, k_nope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return warpgroup_mma(qp_smem, k_pe.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _scores(s, start, hi, limit, row_scale, tok):
        """Masked, scaled scores (base 2) of a tile: -inf where a token is past the split end or not visible."""
        n = gl.expand_dims(start + tok, 0)
        visible = (n < hi) & (n < gl.expand_dims(limit, 1))
        return gl.where(visible, s * gl.expand_dims(row_scale, 1), float("-inf"))

    @gluon.jit
    def _store_lse(lse, r, hb, q_start, split, LSE, LSE_PART, stride_lse_t, stride_lse_j, stride_lse_h, stride_lp_t,
                   stride_lp_h, BLOCK_H: gl.constexpr, FINAL: gl.constexpr):
        """Store the lse [64] of program rows r: into LSE, or with splits into this split's column of LSE_PART."""
        rj = r // BLOCK_H
        rh = hb * BLOCK_H + r % BLOCK_H
        if FINAL:
            gl.store(LSE + q_start.to(gl.int64) * stride_lse_t + rj * stride_lse_j + rh * stride_lse_h, lse)
        else:
            gl.store(LSE_PART + (q_start + rj).to(gl.int64) * stride_lp_t + rh * stride_lp_h + split, lse)

    @gluon.jit
    def _softmax(s, m_i):
        """(p, alpha, new row max) for scores s [64, 64] in base 2 against the running max m_i."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_base)
        p = gl.exp2(s - gl.expand_dims(m_base, 1))
        return p, alpha, m_new

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_wide_decode(Q, kv_desc, lat_desc, BT, SEQLENS, O, LSE, O_PART, LSE_PART, qk_scale, kv_scale, KV_SCALE_PTR,
                         stride_q_t, stride_q_h, stride_bt_b, stride_o_t, stride_o_h,
                         stride_lse_t, stride_lse_j, stride_lse_h,
                         stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
                         H, num_splits,
                         Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr,
                         FINAL: gl.constexpr, FP8: gl.constexpr, SCALE_FROM_PTR: gl.constexpr,
                         CONV_GROUP: gl.constexpr = CONV_GROUP, TMA3: gl.constexpr = TMA3):
        """Grid (head blocks, splits, batch). Program row r: query token j = r // BLOCK_H of the sequence, head
        hb·BLOCK_H + r % BLOCK_H; module docstring for the rest."""
        dt: gl.constexpr = gl.float16 if FP8 else kv_desc.dtype  # what the MMAs take
        MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 32, 16])
        MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 256, 16])
        PL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
        RING: gl.constexpr = kv_desc.layout
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        ZL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])  # 16 bytes of a row per thread
        RS: gl.constexpr = gl.SliceLayout(1, MMA_S)
        RO: gl.constexpr = gl.SliceLayout(1, MMA_O)
        BOX_BYTES: gl.constexpr = 64 * 64 * (1 if FP8 else 2)

        hb, split, b, q_start, prefix, lo, hi = _program_span(SEQLENS, num_splits, Q_PER_SEQ)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        bt_row = BT + b.to(gl.int64) * stride_bt_b
        if SCALE_FROM_PTR:
            kv_scale = gl.load(KV_SCALE_PTR).to(gl.float32)

        # the ring the TMA fills: the MMAs' 16-bit tiles, or (fp8) the bytes, converted into one 16-bit tile
        nope = gl.allocate_shared_memory(kv_desc.dtype, [_STAGES, 64, 512], RING)
        pe = gl.allocate_shared_memory(kv_desc.dtype, [_STAGES, 64, 64], RING)
        if FP8:
            nope16 = gl.allocate_shared_memory(dt, [64, 512], _TILE16)
            pe16 = gl.allocate_shared_memory(dt, [64, 64], _TILE16)
        bars = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_STAGES):
            mbarrier.init(bars.index(i), count=1)
        # the first tiles in flight; the page ids a tile ahead of their TMA
        for i in gl.static_range(_STAGES):
            start = lo + i * 64
            ok = i < n_tiles
            page = gl.load(bt_row + start // PAGE, mask=ok, other=0)
            _issue(kv_desc, lat_desc, nope, pe, bars, i, page, start, ok, PAGE, BOX_BYTES, TMA3)
        page_ahead = gl.load(bt_row + (lo + _STAGES * 64) // PAGE, mask=_STAGES < n_tiles, other=0)

        # ---- q [64 rows, 576] into shared memory (once); over an fp8 pool in fp16, each row divided by a power of
        # two that keeps it below 2^14 (exact, and no fp16 overflow), the factor folded into the row's scores
        qn_smem = gl.allocate_shared_memory(dt, [64, 512], _TILE16)
        qp_smem = gl.allocate_shared_memory(dt, [64, 64], _TILE16)
        qr = gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
        qj = qr // BLOCK_H
        qh = hb * BLOCK_H + qr % BLOCK_H
        q_row = Q + gl.expand_dims((q_start + qj).to(gl.int64) * stride_q_t + qh * stride_q_h, 1)
        qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
        if FP8:
            amax = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, QL))
            for c in gl.static_range(9):
                amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_row + c * 64 + qc).to(gl.float32)), 1))
            qfac = gl.exp2(gl.ceil(gl.log2(gl.maximum(amax * (1.0 / 16384.0), 1.0))))
            inv_f = gl.expand_dims(1.0 / qfac, 1)
            for c in gl.static_range(8):
                qn_smem.slice(c * 64, 64, dim=1).store((gl.load(q_row + c * 64 + qc).to(gl.float32) * inv_f).to(dt))
            qp_smem.store((gl.load(q_row + 512 + qc).to(gl.float32) * inv_f).to(dt))
            row_scale = gl.convert_layout(qfac, RS) * (qk_scale * kv_scale)
        else:
            for c in gl.static_range(8):
                qn_smem.slice(c * 64, 64, dim=1).store(gl.load(q_row + c * 64 + qc))
            qp_smem.store(gl.load(q_row + 512 + qc))
            row_scale = gl.full([64], qk_scale, gl.float32, layout=RS)
        fence_async_shared()
        _cta_barrier()

        r = gl.arange(0, 64, layout=RS)
        limit = prefix + r // BLOCK_H + 1  # row r sees positions < limit
        tok = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA_S))
        m_i = gl.full([64], float("-inf"), gl.float32, layout=RS)
        l_acc = gl.zeros([64, 64], gl.float32, layout=MMA_S)  # per-thread row sums, reduced once at the end
        o = gl.zeros([64, 512], gl.float32, layout=MMA_O)
        s_zero = gl.zeros([64, 64], gl.float32, layout=MMA_S)

        for i in range(n_tiles):
            slot = i % _STAGES
            start = lo + i * 64
            mbarrier.wait(bars.index(slot), (i // _STAGES) & 1)
            if FP8:
                # the bytes → the 16-bit tile (CONV_GROUP blocks a barrier) under q·k; the slot goes back to the TMA
                s = _qk_fp8(qn_smem, qp_smem, nope.index(slot), pe.index(slot), nope16, pe16, s_zero, CL, CONV_GROUP)
                ahead = i + _STAGES
                _issue(kv_desc, lat_desc, nope, pe, bars, slot, page_ahead, lo + ahead * 64, ahead < n_tiles, PAGE,
                       BOX_BYTES, TMA3)
                page_ahead = gl.load(bt_row + (lo + (ahead + 1) * 64) // PAGE, mask=ahead + 1 < n_tiles, other=0)
                k_nope = nope16
            else:
                k_nope = nope.index(slot)
                s = _qk(qn_smem, qp_smem, k_nope, pe.index(slot), s_zero)
            s = warpgroup_mma_wait(0, deps=(s,))
            if start + 64 > hi:  # the last tile: V rows past the split end → 0
                _zero_tail(k_nope, hi - start, ZL)
                fence_async_shared()
                _cta_barrier()
            s = _scores(s, start, hi, limit, row_scale, tok)
            p, alpha, m_i = _softmax(s, m_i)
            l_acc = l_acc * gl.expand_dims(alpha, 1) + p
            pa = gl.convert_layout(p.to(dt), PL)
            o = o * gl.expand_dims(gl.convert_layout(alpha, RO), 1)
            o = warpgroup_mma(pa, k_nope, o, is_async=True)
            o, pa = warpgroup_mma_wait(0, deps=(o, pa))
            _cta_barrier()  # both warpgroups are done with the tile
            if not FP8:
                ahead = i + _STAGES
                _issue(kv_desc, lat_desc, nope, pe, bars, slot, page_ahead, lo + ahead * 64, ahead < n_tiles, PAGE,
                       BOX_BYTES, TMA3)
                page_ahead = gl.load(bt_row + (lo + (ahead + 1) * 64) // PAGE, mask=ahead + 1 < n_tiles, other=0)
        for i in gl.static_range(_STAGES):
            mbarrier.invalidate(bars.index(i))

        l_i = gl.sum(l_acc, 1)
        empty = l_i == 0.0
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        if FP8:
            inv = gl.convert_layout(kv_scale / gl.where(empty, 1.0, l_i), RO)
        else:
            inv = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), RO)
        o = o * gl.expand_dims(inv, 1)
        out_rows, _, _ = _out_rows(gl.arange(0, 64, layout=RO), hb, q_start, split, O, O_PART, stride_o_t, stride_o_h,
                                   stride_op_t, stride_op_h, stride_op_s, BLOCK_H, FINAL)
        dcol = gl.arange(0, 512, layout=gl.SliceLayout(0, MMA_O))
        gl.store(gl.expand_dims(out_rows, 1) + gl.expand_dims(dcol, 0), o.to(out_rows.dtype.element_ty))
        _store_lse(lse, r, hb, q_start, split, LSE, LSE_PART, stride_lse_t, stride_lse_j, stride_lse_h, stride_lp_t,
                   stride_lp_h, BLOCK_H, FINAL)


def shared_bytes(stages: int = STAGES, fp8: bool = False) -> int:
    """Shared memory of one program: q (72 KB) and the ring of tiles (72 KB each; over an fp8 pool 36 KB each, plus
    the 16-bit tile they are converted into); the softmax's exchanges come on top."""
    tile = 64 * 576 * 2
    return tile + (stages * tile // 2 + tile if fp8 else stages * tile)


# a program's fixed cost in tiles: q and filling the ring (about one tile), plus with splits the fp32 partial it writes
# and the combine reads back (128 KB each way per program: about three tiles more)
FIXED_TILES = 1
PARTIAL_TILES = 3
# the most splits `auto_splits` gives a sequence (`split_cap`). The two-warpgroup kernel (gluon_mla_seesaw): 32 — at
# B=1, 128 heads bf16 on an H200, 32 splits against 64: 4k 20.6 → 14.9 µs, 8k 22.6 → 18.0, 16k 28.4 → 24.3 (the
# tuner's trials, bench/results/NVIDIA_H200/tuning/2026-12-02_seesaw_retune). This kernel: past 32 only while each
# split keeps 4 tiles, up to 64 — over fp8 32 against 64 at 4k 17.7 against 21.6 µs, 8k 23.8 against 25.3, but 16k
# 36.2 against 31.8 (bench/results/NVIDIA_H200/tuning/2026-12-02_tma3_retune); over bf16 4k 15.5 against 20.1, 8k
# 19.9 against 23.0, 16k 29.0 against 29.6
MAX_SPLITS = 64
SEESAW_MAX_SPLITS = 32
WIDE_TILES_PAST_32 = 4
# over an fp8 pool the two-warpgroup kernel (gluon_mla_seesaw_fp8) runs only where a split holds more tiles than
# this: its program costs more to start and finish than this kernel's, so it wins from about 48 tiles (3k tokens) a
# split and loses at 16 or fewer. On an H200 at 128 heads (bench/results/NVIDIA_H200/attention/2026-12-02_seesaw_fp8)
# this kernel against it: B=128 at 1k (16 tiles) 0.128 against 0.151 ms, at 2k (32) 0.223 against 0.229, at 3k
# (48) 0.319 against 0.306, at 8k 0.801 against 0.705; B=8 at 4k (8 splits of 8 tiles) 0.041 against 0.050
SEESAW_FP8_MIN_TILES = 32


def split_cap(tiles: int, seesaw: bool) -> int:
    """The most splits `auto_splits` gives a sequence of `tiles` KV tiles: SEESAW_MAX_SPLITS for the two-warpgroup
    kernel; for this one 32, or more (up to MAX_SPLITS) while each split keeps WIDE_TILES_PAST_32 tiles."""
    if seesaw:
        return SEESAW_MAX_SPLITS
    return min(MAX_SPLITS, max(32, tiles // WIDE_TILES_PAST_32))


@functools.lru_cache(maxsize=256)
def auto_splits(batch: int, head_blocks: int, capacity: int, sm_count: int, seesaw: bool = False) -> int:
    """KV splits per sequence: the count s (1 ≤ s ≤ `split_cap`, at least one tile per split) that minimises
    ⌈programs / SMs⌉ · (tiles per split + fixed cost) — waves of one-per-SM programs times one program's work; the
    smallest s among equals. Fitted to H200 timings (bench/results/NVIDIA_H200/attention/2026-12-01_gluon_wide):
    B=128 at 1k–16k and B=64 at 8k–16k one split, B=32 at 8k two, B=8 at 1k–16k eight. A lone sequence gets the
    cap (`split_cap`; `seesaw`: for the two-warpgroup kernel)."""
    tiles = -(-capacity // BLOCK_N)
    best, best_cost = 1, None
    for s in range(1, max(1, min(split_cap(tiles, seesaw), tiles)) + 1):
        fixed = FIXED_TILES + (PARTIAL_TILES if s > 1 else 0)
        cost = -(-batch * head_blocks * s // sm_count) * (-(-tiles // s) + fixed)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _tokens(kv_cache: torch.Tensor) -> torch.Tensor:
    """A [P, page, 576] pool as [P·page, 576] (a view)."""
    return kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], 576)


def kv_descriptor(kv_cache: torch.Tensor):
    """The TMA descriptor of a [P, page, 576] pool (bf16/fp16, or fp8 as uint8 bytes or as float8_e4m3fn for the
    e4m3 MMAs) seen as [P·page, 576] with
    [64, 64] boxes. Built per call and not kept: the launcher encodes the hardware descriptor at every launch
    anyway, and a cache of these would hold every pool it ever saw alive."""
    return TensorDescriptor.from_tensor(_tokens(kv_cache), [64, 64], _box_layout(kv_cache.dtype))


def latent_descriptor(kv_cache: torch.Tensor):
    """The TMA descriptor of a [P, page, 576] pool's latent columns seen as [8, P·page, 64] (64-column block,
    token, column; strides 64, 576, 1) with [8, 64, 64] boxes: one box is a tile's whole latent, landing as the
    eight [64, 64] panels the MMAs read."""
    flat = _tokens(kv_cache)
    blocks = flat.as_strided((8, flat.shape[0], 64), (64, 576, 1))
    return TensorDescriptor.from_tensor(blocks, [8, 64, 64], _box_layout(kv_cache.dtype, 3))


@functools.lru_cache(maxsize=None)
def _box_layout(dtype: torch.dtype, rank: int = 2):
    """The shared layout of a [64, 64] TMA box (rank 2) or of eight of them (rank 3) of the pool's element type
    (fixed per dtype; asked every call)."""
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.uint8: gl.uint8,
            torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for([8, 64, 64][-rank:], elem)


def launch(q3: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
           out3: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
           lse_strides: tuple[int, int, int], part_strides: tuple[int, int, int, int, int], qk_scale: float, *,
           q_per_seq: int, splits: int, kv_scale: float = 1.0, kv_scale_ptr: torch.Tensor | None = None,
           conv_group: int = CONV_GROUP, tma3: bool = TMA3, seesaw: bool = SEESAW) -> None:
    """Launch `_mla_wide_decode` over grid (head blocks, splits, B) — or, with `seesaw` (the default), a
    two-warpgroup kernel over the same grid and outputs: gluon_mla_seesaw's over a bf16/fp16 pool,
    gluon_mla_seesaw_fp8's over an fp8 pool (bf16 queries; ValueError for others). Whether the two-warpgroup kernel
    pays over fp8 is the caller's choice (triton_kernels `_gluon_kernel`).

    q3: [B·S_q, H, 576] bf16/fp16 queries (H·S_q a multiple of 64; the cache's dtype over a 16-bit pool);
    kv_cache: [P, page, 576] bf16/fp16, or uint8 e4m3 bytes (value = e4m3 · kv_scale), page 64 or 128, contiguous;
    block_table [B, max_pages] int32; seqlens [B] int32; out3 [B·S_q, H, 512] (written with splits == 1), lse
    through lse_strides; with splits > 1 the fp32 partials o_part [B·S_q, H, splits, 512] and lse_part
    [B·S_q, H, splits] (part_strides: o_part's three, lse_part's two). qk_scale: softmax scale · log2(e);
    kv_scale: an fp8 pool's scale, or read from kv_scale_ptr [1] fp32 when given. conv_group: an fp8 tile's column
    blocks converted per barrier (CONV_GROUPS); tma3: the wide kernel's one-box latent load. Graph-safe (no host
    sync; the descriptor holds the pool's address and shape, which a captured graph keeps)."""
    T, H, _ = q3.shape
    B = seqlens.shape[0]
    why = unfit(H, q_per_seq, kv_cache.dtype, q3.dtype, kv_cache.shape[1])
    if why:
        raise ValueError(f"mla gluon (wide): {why}")
    if q3.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("mla gluon (wide): q needs a contiguous last dimension and the cache must be contiguous "
                         "(it is read by TMA as one [pages · page, 576] tensor)")
    if conv_group not in CONV_GROUPS:
        raise ValueError(f"mla gluon (wide): conv_group={conv_group}: an fp8 tile's nine column blocks are converted "
                         f"{' / '.join(map(str, CONV_GROUPS))} at a time")
    block_h = ROWS // q_per_seq
    from_ptr = kv_scale_ptr is not None
    if seesaw:  # one of the two-warpgroup kernels: over fp8 the e4m3 one, which also takes the pool's scale
        from pdlab.attention import gluon_mla_seesaw as S

        if kv_cache.dtype == torch.uint8:
            from pdlab.attention import gluon_mla_seesaw_fp8 as S8

            why = S8.unfit(q3.dtype)
            if why:
                raise ValueError(f"mla gluon (seesaw): {why}; run seesaw=0 (the wide kernel) for these queries")
            kernel, pool = S8._mla_seesaw_fp8_decode, kv_cache.view(torch.float8_e4m3fn)  # bytes typed for e4m3 MMAs
            scale, extra = (kv_scale, kv_scale_ptr if from_ptr else seqlens), {"SCALE_FROM_PTR": from_ptr}
        else:
            kernel, pool, scale, extra = S._mla_seesaw_decode, kv_cache, (), {}
        kernel[(H // block_h, splits, B)](
            q3, kv_descriptor(pool), latent_descriptor(pool), block_table, seqlens, out3, lse, o_part, lse_part,
            qk_scale, *scale, q3.stride(0), q3.stride(1), block_table.stride(0), out3.stride(0), out3.stride(1),
            *lse_strides, *part_strides, splits,
            Q_PER_SEQ=q_per_seq, BLOCK_H=block_h, PAGE=kv_cache.shape[1], FINAL=splits == 1, **extra,
            num_warps=int(S.WARPS))
        return
    desc = kv_descriptor(kv_cache)
    _mla_wide_decode[(H // block_h, splits, B)](
        q3, desc, latent_descriptor(kv_cache) if tma3 else desc, block_table, seqlens, out3, lse, o_part, lse_part,
        qk_scale, kv_scale, kv_scale_ptr if from_ptr else seqlens,
        q3.stride(0), q3.stride(1), block_table.stride(0), out3.stride(0), out3.stride(1), *lse_strides,
        *part_strides, H, splits,
        Q_PER_SEQ=q_per_seq, BLOCK_H=block_h, PAGE=kv_cache.shape[1], FINAL=splits == 1,
        FP8=kv_cache.dtype == torch.uint8, SCALE_FROM_PTR=from_ptr, CONV_GROUP=conv_group, TMA3=bool(tma3),
        num_warps=WARPS)


def programs_per_sm() -> int:
    """Programs one sm90 SM holds: shared memory allows one."""
    return SM90.programs_per_sm(registers=None, shared=shared_bytes(), warps=WARPS)["programs_per_sm"]
