"""fp8 MLA decode for Hopper (sm90) in Gluon: the cache bytes stream through a cp.async ring in shared memory and
each thread converts exactly the bytes of its own wgmma register fragments.

Why: the Triton kernels of triton_kernels.py upcast an fp8 tile in registers and hand it to `tl.dot`, which stages
it through shared memory again; with few heads per program that tile work, not HBM, bounds them (an fp8 pool was
slower than a bf16 one at 16 heads: bench/results/NVIDIA_H200/attention). Here one program (one warpgroup, two per
SM) holds every query row of a sequence (heads × S_q ≤ 32, padded to HM = 16 or 32) and walks one split of its KV
range in tiles of 64 tokens, token-major ("swap AB"), so the tile's tokens are the wgmma's M side:

- cp.async ring of STAGES = 2 tiles (32 KB of the 512 latent columns + 4 KB of the 64 rope columns each): thread
  t = 32w + 4·rlo + q copies the 16-byte pieces of its own q·k fragments (tokens 16w + rlo and + 8, columns
  64g + 16q … + 15). The latent tile's shared layout places token τ at row T(τ) (bits x0…x5 → x3, x1, x0^x2, x0,
  x4, x5) and XORs each 16-byte piece's index with the row's low three bits, so both read patterns below and the
  copies are free of bank conflicts. The tile after the current one is in flight while it is computed.
- s^T [64, HM] = K · q^T: per 64-column group the thread's bytes → fp16 (`cvt.rn.f16x2.e4m3x2`) are its wgmma A
  fragment, because the MMA's K order inside a group is permuted (MMA column 16c + 8n + 2q + u is model column
  16q + 4c + 2n + u, `perm_group`); q sits in shared memory in that order. Each group's conversion overlaps the
  previous group's MMA.
  The q·k bytes are converted in the order the shared loads bring them (four bytes of one token per register);
  the V^T fragments pair two tokens, one byte permute per register.
- Online softmax over the tile (base 2, scores scaled by softmax scale · kv_scale · q's per-row power of two; the
  mask only on tiles that reach the split end or the causal rows), p^T to shared memory as fp16. Lazy rescaling:
  the running max moves, and o and the row sums are rescaled, only when some row's max grew by more than
  RESCALE_LOG2 (p then stays ≤ 2^8); the row sums are kept per (token slot, row) and reduced once at the end.
- o^T [512, HM] += V^T · p^T as eight [64, HM] accumulators, V^T's A fragments read from the whole tile with the
  rows of o^T permuted (row r = 16w + 8·rsel + rlo of accumulator i is latent column 128w + 16·rlo + 2i + rsel):
  a thread's fragments are then 16 consecutive bytes of each of its 16 tokens, one 16-byte shared load each.
- The result and lse, or per-split fp32 partials that triton_kernels' `_mla_combine` merges (the output contract of
  `_mla_fwd`); the output is relabelled so that each thread writes 16 consecutive columns per row.

q goes to fp16 divided per row by a power of two keeping |q| ≤ 2^14 (exact: fp16 has more mantissa than bf16 and
cannot overflow). Rows of the tile at positions ≥ the split end are not loaded (the cp.async zero-fills them), so
pages past a sequence's length are never read.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from pdlab.kernels.arch import SM90, wgmma_unavailable

try:  # Gluon (Triton ≥ 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - reported by `available()`
    HAVE_GLUON = False

BLOCK_N = 64  # tokens per tile: the wgmma M of one warpgroup
# the latent tile's shared layout [64 tokens, 512 bytes]: the (token, column) of each bit of a byte's offset — bits
# 0–8 the column (16-byte piece p = bits 4–8), bits 9–14 the row ρ; token τ = T⁻¹(ρ), and the low three bits of p
# are XORed with ρ's (see the module docstring)
NOPE_OFFSET_BASES = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64], [0, 128], [0, 256],
                     [8, 16], [2, 32], [4, 64], [5, 0], [16, 0], [32, 0]]
# how far (base 2) a row's max may grow before the running max moves (FA4's lazy rescaling)
RESCALE_LOG2 = 8.0
MAX_ROWS = 32  # query rows (heads × S_q) one program holds: its 8 accumulators [64, HM] stay in registers
# the balanced schedule (`balanced_fits`): no program gets fewer KV tiles than this unless its sequence has fewer
MIN_SPAN_TILES = 4  # 256 tokens, as the uniform rule's (`auto_splits` min_tokens)
MAX_BALANCED_BATCH = 1024  # sequences whose tile counts one program sums in registers (4 warps × 8)
BALANCED_SPLIT_FACTOR = 2  # a sequence's programs: up to this many times slots / batch (`balanced_max_splits`)
# schedule "auto": the balanced schedule from this many sequences (below, the uniform one was as fast or faster on
# an H200 at uniform lengths, where the balanced grid's idle programs show: bench/results/NVIDIA_H200/attention/
# 2026-12-01_fp8_balanced)
BALANCED_MIN_BATCH = 32


def perm_group(device=None) -> torch.Tensor:
    """[64] int64: the model column (within a 64-column group) of each MMA column: 16c + 8n + 2q + u ↦
    16q + 4c + 2n + u (thread q's 16 consecutive bytes are its A fragment's columns)."""
    mk = torch.arange(64, device=device)
    c, n, q, u = mk // 16, (mk // 8) % 2, (mk // 2) % 4, mk % 2
    return 16 * q + 4 * c + 2 * n + u


def available(device: torch.device, q_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when the kernel can run on `device` for queries of `q_dtype`, else why not."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "needs a CUDA GPU (Gluon kernels are not interpreted)"
    if q_dtype == torch.float32:
        return "fp32 queries are the oracle's precision (the kernel computes in fp16)"
    return wgmma_unavailable(device)


def rows_fit(heads: int, q_len: int) -> bool:
    """Whether one program holds every query row (heads × S_q ≤ 32): the case this kernel is for."""
    return heads * q_len <= MAX_ROWS


def unfit(heads: int, q_len: int, fp8: bool) -> str | None:
    """None when the kernel takes this problem — decode (q_len ≥ 1 per sequence) over an fp8 pool with
    heads × q_len ≤ 32 — else why not. What the launcher's "auto" and the tuner's search space both follow."""
    if not fp8 or q_len <= 0:
        return "it is the decode kernel for fp8 pools"
    if not rows_fit(heads, q_len):
        return f"{heads} heads × S_q {q_len} exceed the {MAX_ROWS} query rows one program holds"
    return None


if HAVE_GLUON:
    _RESCALE_LOG2 = gl.constexpr(RESCALE_LOG2)
    _MIN_SPAN_TILES = gl.constexpr(MIN_SPAN_TILES)
    _NOPE_SMEM = gl.constexpr(gl.SharedLinearLayout(offset_bases=NOPE_OFFSET_BASES))
    _CVT = gl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")

    @gluon.jit
    def _to_f16(x):
        """uint8 e4m3 bits → their fp16 values (exact), two per conversion instruction."""
        return gl.inline_asm_elementwise(_CVT, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _split8(x):
        """[R, C, 2, 2, 2] → the eight [R, C] tensors x[..., a, b, c], in the order 4a + 2b + c."""
        c0, c1 = gl.split(x)
        b0c0, b1c0 = gl.split(c0)
        b0c1, b1c1 = gl.split(c1)
        x0, x4 = gl.split(b0c0)
        x2, x6 = gl.split(b1c0)
        x1, x5 = gl.split(b0c1)
        x3, x7 = gl.split(b1c1)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @gluon.jit
    def _qk_groups(x):
        """A thread's QK bytes [64 τ, 512 cols] (col = 64g + 16q + 4c + 2n + u) → the eight groups' [64 τ, 64 MMA
        columns 16c + 8n + 2q + u] (a relabelling of the thread's registers)."""
        x = gl.reshape(x, [64, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # τ, g2 g1 g0, q1 q0, c1 c0 n u
        x = gl.permute(x, (0, 6, 7, 8, 4, 5, 9, 1, 2, 3))
        return _split8(gl.reshape(x, [64, 64, 2, 2, 2]))

    @gluon.jit
    def _pe_group(x):
        """The q_pe group's bytes [64 τ, 64 cols] (col = 16q + 4c + 2n + u) → [64 τ, 64 MMA columns]."""
        x = gl.permute(gl.reshape(x, [64, 2, 2, 2, 2, 2, 2]), (0, 3, 4, 5, 1, 2, 6))
        return gl.reshape(x, [64, 64])

    @gluon.jit
    def _pv_tiles(y):
        """A thread's PV bytes [64 τ, 512 d] (d = 128w + 16·rlo + 2i + rsel) → the eight V^T tiles i
        [64 rows 16w + 8·rsel + rlo, 64 τ] (a relabelling of the thread's registers). rsel is the lowest bit of d
        so that a fragment register's two rows r, r + 8 are adjacent bytes of one token."""
        # τ (6 bits) | w1 w0 rlo2 rlo1 rlo0 i2 i1 i0 rsel
        y = gl.reshape(y, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        y = gl.permute(y, (6, 7, 14, 8, 9, 10, 0, 1, 2, 3, 4, 5, 11, 12, 13))
        return _split8(gl.reshape(y, [64, 64, 2, 2, 2]))

    @gluon.jit
    def _operand(x, AL: gl.constexpr):
        """A [64, 64] uint8 e4m3 tile in a thread-local order → the fp16 wgmma register A operand."""
        return _to_f16(gl.convert_layout(x, AL, assert_trivial=True))

    @gluon.jit
    def _qk_operand(x, AL: gl.constexpr):
        """A q·k group [64 τ, 64 MMA columns] → the fp16 wgmma register A operand, converted in x's own register
        order: there four consecutive registers are four consecutive bytes of one token (one 32-bit word of the
        shared load), in the operand's order they are two tokens' (the relabelling would cost a byte permute per
        word). The fp16 pairs (model columns 2n + u, u = 0, 1) are the operand's pairs either way."""
        return gl.convert_layout(_to_f16(x), AL, assert_trivial=True)

    @gluon.jit
    def _program_span(SEQLENS, num_splits, Q_PER_SEQ: gl.constexpr):
        """A decode program's place in grid (head blocks, splits, batch) and its KV range: (head block, split,
        sequence b, its first query token, the tokens before its queries, [lo, hi)). Splits are whole 64-token
        tiles; a split past the sequence's end has lo ≥ hi. Shared by the Gluon decode kernels."""
        hb = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seqlen = gl.load(SEQLENS + b)
        split_len = gl.cdiv(gl.cdiv(seqlen, num_splits), 64) * 64
        lo = split * split_len
        return hb, split, b, b * Q_PER_SEQ, seqlen - Q_PER_SEQ, lo, gl.minimum(lo + split_len, seqlen)

    @gluon.jit
    def _out_rows(orow, hb, q_start, split, O, O_PART, stride_o_t, stride_o_h, stride_op_t, stride_op_h,
                  stride_op_s, BLOCK_H: gl.constexpr, FINAL: gl.constexpr):
        """(row pointers, query token, head) of program rows `orow`: the output's rows, or with splits the fp32
        partials' rows of this split."""
        oj = orow // BLOCK_H
        oh = hb * BLOCK_H + orow % BLOCK_H
        ot = (q_start + oj).to(gl.int64)
        if FINAL:
            out_rows = O + (ot * stride_o_t + oh * stride_o_h)
        else:
            out_rows = O_PART + (ot * stride_op_t + oh * stride_op_h + split * stride_op_s)
        return out_rows, oj, oh

    @gluon.jit
    def _issue(nope_ring, pe_ring, slot, KV, row_nope, row_pe, ok_nope, ok_pe, col_nope, col_pe):
        """cp.async of one tile's bytes into ring slot (rows whose `ok` is false are zero-filled, not read): each
        thread copies the sixteen 16-byte pieces of its own q·k fragments and two of the rope columns."""
        _cp_async(nope_ring.index(slot), KV + row_nope + col_nope, mask=ok_nope)
        _cp_async(pe_ring.index(slot), KV + 512 + row_pe + col_pe, mask=ok_pe)
        async_copy.commit_group()

    @gluon.jit
    def _pages(bt_row, start, hi, tau, PAGE: gl.constexpr):
        """Page ids [64] of the tile at `start` (0 past hi) in tau's layout."""
        n = start + tau
        return gl.load(bt_row + n // PAGE, mask=n < hi, other=0)

    @gluon.jit
    def _rows(page, start, hi, tau, stride_kv_p, stride_kv_o, PAGE: gl.constexpr):
        """(element offsets [64, 1] int64 of the tile's rows, their mask [64, 1])."""
        n = start + tau
        addr = page.to(gl.int64) * stride_kv_p + (n % PAGE).to(gl.int64) * stride_kv_o
        return gl.expand_dims(addr, 1), gl.expand_dims(n < hi, 1)

    @gluon.jit
    def _qk_async(s, a_prev, x, q_smem, AL: gl.constexpr):
        """Convert group x and issue its MMA after the previous one's; wait until that previous one is done (its
        register operand a_prev is free). Returns (the accumulator in flight, x's operand)."""
        a = _qk_operand(x, AL)
        s = warpgroup_mma(a, q_smem.permute((1, 0)), s, is_async=True)
        s, a_prev = warpgroup_mma_wait(1, deps=(s, a_prev))
        return s, a

    @gluon.jit
    def _pv_async(t_prev, a_prev, o, v, p_smem, AL: gl.constexpr):
        """Convert V^T tile v and issue its MMA (into o); wait for the previous tile's MMA. Returns (the previous
        tile's accumulator, this one's in flight, v's operand)."""
        a = _operand(v, AL)
        t = warpgroup_mma(a, p_smem.permute((1, 0)), o, is_async=True)
        o_prev, a_prev = warpgroup_mma_wait(1, deps=(t_prev, a_prev))
        return o_prev, t, a

    @gluon.jit
    def _add_i32(a, b):
        return a + b

    @gluon.jit
    def _balanced_span(SEQLENS, META, B, slots, max_splits, Q_PER_SEQ: gl.constexpr, BLOCK_B: gl.constexpr):
        """Program (b, split) of the balanced grid (B, max_splits): sequence b of n_b = ⌈L_b / 64⌉ tiles gets
        s_b = min(max_splits, max(1, ⌈n_b / P⌉)) programs of ⌈n_b / s_b⌉ tiles each, P the even share
        max(MIN_SPAN_TILES, ⌈Σ n_b / slots⌉) where Σ s_b then fits the slots, else max(MIN_SPAN_TILES,
        ⌈Σ n_b / (slots − B)⌉), for which Σ s_b ≤ Σ (n_b / P + 1) ≤ slots whatever the lengths: one wave;
        programs past s_b have no work. b stays the program id (uniform registers: a b read
        from memory cost the tile loop 5 %). Split 0 writes META[b] = (b · max_splits, s_b) for the combine.
        Returns (s_b, or 0 for a program without work, b, its first query token, the tokens before its queries,
        [lo, hi))."""
        b = gl.program_id(0)
        split = gl.program_id(1)
        SL: gl.constexpr = gl.BlockedLayout([BLOCK_B // 128], [32], [4], [0])
        i = gl.arange(0, BLOCK_B, layout=SL)
        n = gl.cdiv(gl.load(SEQLENS + i, mask=i < B, other=0), 64)
        total = gl.sum(n, 0)
        # the even share ⌈Σ n / slots⌉ where its rounding still fits the slots (uniform lengths), else the bound
        # that always fits
        even = gl.maximum(gl.cdiv(total, slots), _MIN_SPAN_TILES)
        fits = gl.sum(gl.where(i < B, gl.maximum(gl.cdiv(n, even), 1), 0), 0) <= slots
        per = gl.where(fits, even, gl.maximum(gl.cdiv(total, slots - B), _MIN_SPAN_TILES))
        seqlen = gl.load(SEQLENS + b)
        n_b = gl.cdiv(seqlen, 64)
        s_b = gl.minimum(gl.maximum(gl.cdiv(n_b, per), 1), max_splits)
        active = split < s_b
        gl.store(META + 2 * b, b * max_splits, mask=split == 0)
        gl.store(META + 2 * b + 1, s_b, mask=split == 0)
        span = gl.cdiv(n_b, s_b) * 64
        lo = gl.where(active, split * span, 0)
        hi = gl.where(active, gl.minimum(lo + span, seqlen), 0)
        return gl.where(active, s_b, 0), b, b * Q_PER_SEQ, seqlen - Q_PER_SEQ, lo, hi

    @gluon.jit(do_not_specialize=["num_splits"])
    def _mla_fp8_decode(Q, KV, BT, SEQLENS, O, LSE, O_PART, LSE_PART, META, kv_scale, KV_SCALE_PTR, qk_scale,
                        stride_q_t, stride_q_h, stride_kv_p, stride_kv_o, stride_bt_b,
                        stride_o_t, stride_o_h, stride_lse_t, stride_lse_j, stride_lse_h,
                        stride_op_t, stride_op_h, stride_op_s, stride_lp_t, stride_lp_h,
                        H, num_splits, B, slots,
                        Q_PER_SEQ: gl.constexpr, BLOCK_H: gl.constexpr, HM: gl.constexpr, PAGE: gl.constexpr,
                        STAGES: gl.constexpr, FINAL: gl.constexpr, SCALE_FROM_PTR: gl.constexpr,
                        OUT_LAYOUT: gl.constexpr, BALANCED: gl.constexpr, BLOCK_B: gl.constexpr):
        """Grid (head blocks, splits, batch), or with BALANCED (batch, num_splits) (`_balanced_span`; partials then
        in rows (b · num_splits + split) · S_q + j). Program rows r < HM: query token j = r // BLOCK_H of the
        sequence, head hb·BLOCK_H + r % BLOCK_H; module docstring for the rest."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        # thread 32w + 4·rlo + q: QK bytes — tokens 16w + rlo (+8), columns 64g + 16q … + 15 (also what it copies)
        QKL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [0, 64], [0, 128], [0, 256]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 512])
        QKP: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 64])
        # PV bytes — tokens 2q + c + 8·t3 + 16·kk, columns 128w + 16·rlo … + 15 (V^T's A fragments, d permuted)
        PVL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[[0, 128], [0, 256]],
            block_bases=[], shape=[64, 512])
        # the nope tile: token τ at row T(τ) (T: bits x0..x5 → x3, x1, x0^x2, x0, x4, x5), 16-byte pieces XOR
        # the row's low three bits: both reads and the copies are free of bank conflicts
        NOPE_SMEM: gl.constexpr = _NOPE_SMEM
        PE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HM, 64], gl.float16)
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(0, MMA)

        if BALANCED:
            programs, b, q_start, prefix, lo, hi = _balanced_span(SEQLENS, META, B, slots, num_splits, Q_PER_SEQ,
                                                                  BLOCK_B)
            hb = 0
            if programs == 0:  # past the sequence's programs: nothing to do
                return
        else:
            hb, split, b, q_start, prefix, lo, hi = _program_span(SEQLENS, num_splits, Q_PER_SEQ)
        if SCALE_FROM_PTR:
            kv_scale = gl.load(KV_SCALE_PTR).to(gl.float32)

        # ---- q: rows → fp16 / per-row power of two, columns in MMA order per group, into shared memory
        qr = gl.arange(0, HM, layout=gl.SliceLayout(1, QL))
        qj = qr // BLOCK_H
        qh = hb * BLOCK_H + qr % BLOCK_H
        q_ok = gl.expand_dims((qj < Q_PER_SEQ) & (qh < H), 1)
        q_row = Q + gl.expand_dims((q_start + qj).to(gl.int64) * stride_q_t + qh * stride_q_h, 1)
        mk = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
        amax = gl.max(gl.abs(gl.load(q_row + 512 + gl.expand_dims(mk, 0), mask=q_ok, other=0.0).to(gl.float32)), 1)
        for g in gl.static_range(8):
            qg = gl.load(q_row + g * 64 + gl.expand_dims(mk, 0), mask=q_ok, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(qg), 1))
        qfac = gl.exp2(gl.ceil(gl.log2(gl.maximum(amax * (1.0 / 16384.0), 1.0))))
        inv_f = gl.expand_dims(1.0 / qfac, 1)
        # MMA column mk of a group holds model column 16q + 4c + 2n + u (perm_group)
        pk = gl.expand_dims(16 * ((mk // 2) % 4) + 4 * (mk // 16) + 2 * ((mk // 8) % 2) + mk % 2, 0)
        qn_smem = gl.allocate_shared_memory(gl.float16, [8, HM, 64], QS)
        for g in gl.static_range(8):
            qg = gl.load(q_row + g * 64 + pk, mask=q_ok, other=0.0).to(gl.float32)
            qn_smem.index(g).store((qg * inv_f).to(gl.float16))
        qp_smem = gl.allocate_shared_memory(gl.float16, [HM, 64], QS)
        qp_smem.store((gl.load(q_row + 512 + pk, mask=q_ok, other=0.0).to(gl.float32) * inv_f).to(gl.float16))

        r = gl.arange(0, HM, layout=ROWS)
        rj = r // BLOCK_H
        rh = hb * BLOCK_H + r % BLOCK_H
        row_ok = (rj < Q_PER_SEQ) & (rh < H)
        limit = prefix + rj + 1  # row r sees positions < limit
        row_scale = qk_scale * kv_scale * gl.convert_layout(qfac, ROWS)

        # ---- this thread's tokens and columns of every tile
        tau = gl.arange(0, 64, layout=gl.SliceLayout(1, QKL))
        col_nope = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, QKL)), 0)
        col_pe = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QKP)), 0)
        bt_row = BT + b.to(gl.int64) * stride_bt_b

        nope_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 512], NOPE_SMEM)
        pe_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 64], PE_SMEM)
        p_smem = gl.allocate_shared_memory(gl.float16, [HM, 64], QS)

        for i in gl.static_range(STAGES - 1):  # the first tiles in flight
            start = lo + i * 64
            row, ok = _rows(_pages(bt_row, start, hi, tau, PAGE), start, hi, tau, stride_kv_p, stride_kv_o, PAGE)
            _issue(nope_ring, pe_ring, i, KV, row, gl.convert_layout(row, QKP), ok, gl.convert_layout(ok, QKP),
                   col_nope, col_pe)
        page_ahead = _pages(bt_row, lo + (STAGES - 1) * 64, hi, tau, PAGE)
        fence_async_shared()
        _cta_barrier()  # q's shared copies are written

        m_i = gl.full([HM], float("-inf"), gl.float32, layout=ROWS)
        # p's row sums: at HM 16 per (token slot, row), reduced once at the end; at HM 32 (no registers to spare)
        # reduced every tile
        SUM_AT_END: gl.constexpr = HM == 16
        if SUM_AT_END:
            l_acc = gl.zeros([64, HM], gl.float32, layout=MMA)
        else:
            l_acc = gl.zeros([HM], gl.float32, layout=ROWS)
        o0 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o1 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o2 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o3 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o4 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o5 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o6 = gl.zeros([64, HM], gl.float32, layout=MMA)
        o7 = gl.zeros([64, HM], gl.float32, layout=MMA)
        tok = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        n_tiles = gl.cdiv(hi - lo, 64)
        for i in range(n_tiles):
            start = lo + i * 64
            # the tile STAGES - 1 ahead goes in flight (its page ids were read an iteration ago)
            ahead = start + (STAGES - 1) * 64
            row, ok = _rows(page_ahead, ahead, hi, tau, stride_kv_p, stride_kv_o, PAGE)
            _issue(nope_ring, pe_ring, (i + STAGES - 1) % STAGES, KV, row, gl.convert_layout(row, QKP), ok,
                   gl.convert_layout(ok, QKP), col_nope, col_pe)
            page_ahead = _pages(bt_row, ahead + 64, hi, tau, PAGE)
            async_copy.wait_group(STAGES - 1)  # this thread's pieces of tile i have landed
            slot = i % STAGES

            # s^T = K·q^T from the thread's own pieces
            x0, x1, x2, x3, x4, x5, x6, x7 = _qk_groups(nope_ring.index(slot).load(QKL))
            xp = _pe_group(pe_ring.index(slot).load(QKP))
            # each group's bytes are converted while the previous group's MMA runs
            a = _qk_operand(x0, AL)
            s = warpgroup_mma(a, qn_smem.index(0).permute((1, 0)), gl.zeros([64, HM], gl.float32, layout=MMA),
                              is_async=True)
            s, a = _qk_async(s, a, x1, qn_smem.index(1), AL)
            s, a = _qk_async(s, a, x2, qn_smem.index(2), AL)
            s, a = _qk_async(s, a, x3, qn_smem.index(3), AL)
            s, a = _qk_async(s, a, x4, qn_smem.index(4), AL)
            s, a = _qk_async(s, a, x5, qn_smem.index(5), AL)
            s, a = _qk_async(s, a, x6, qn_smem.index(6), AL)
            s, a = _qk_async(s, a, x7, qn_smem.index(7), AL)
            s, a = _qk_async(s, a, xp, qp_smem, AL)
            s, a = warpgroup_mma_wait(0, deps=(s, a))

            s = s * gl.expand_dims(row_scale, 0)
            if start + 64 > gl.minimum(hi, prefix + 1):  # the tile reaches the split end or the causal rows
                n = gl.expand_dims(start + tok, 1)
                s = gl.where((n < hi) & (n < gl.expand_dims(limit, 0)), s, float("-inf"))
            # the running max moves (and o, l are rescaled) only when a row's max grew by more than RESCALE_LOG2:
            # p = 2^(s - m) then stays ≤ 2^RESCALE_LOG2, exact enough in fp16 and far from fp32's range
            m_new = gl.maximum(m_i, gl.max(s, 0))
            grow = gl.max(gl.where(m_new > m_i, m_new - m_i, 0.0), 0)
            if grow > _RESCALE_LOG2:
                alpha_r = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
                alpha = gl.expand_dims(alpha_r, 0)
                o0, o1, o2, o3 = o0 * alpha, o1 * alpha, o2 * alpha, o3 * alpha
                o4, o5, o6, o7 = o4 * alpha, o5 * alpha, o6 * alpha, o7 * alpha
                if SUM_AT_END:
                    l_acc = l_acc * alpha
                else:
                    l_acc = l_acc * alpha_r
                m_i = m_new
            p = gl.exp2(s - gl.expand_dims(gl.where(m_i == float("-inf"), 0.0, m_i), 0))
            if SUM_AT_END:
                l_acc = l_acc + p
            else:
                l_acc = l_acc + gl.sum(p, 0)
            p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
            fence_async_shared()
            _cta_barrier()  # p^T written, and every thread's pieces of tile i have landed

            # o^T += V^T·p^T, V^T's fragments read from the whole tile
            v0, v1, v2, v3, v4, v5, v6, v7 = _pv_tiles(nope_ring.index(slot).load(PVL))
            # each V^T tile is converted while the previous tile's MMA runs
            a = _operand(v0, AL)
            t0 = warpgroup_mma(a, p_smem.permute((1, 0)), o0, is_async=True)
            o0, t1, a = _pv_async(t0, a, o1, v1, p_smem, AL)
            o1, t2, a = _pv_async(t1, a, o2, v2, p_smem, AL)
            o2, t3, a = _pv_async(t2, a, o3, v3, p_smem, AL)
            o3, t4, a = _pv_async(t3, a, o4, v4, p_smem, AL)
            o4, t5, a = _pv_async(t4, a, o5, v5, p_smem, AL)
            o5, t6, a = _pv_async(t5, a, o6, v6, p_smem, AL)
            o6, t7, a = _pv_async(t6, a, o7, v7, p_smem, AL)
            o7, a = warpgroup_mma_wait(0, deps=(t7, a))
            _cta_barrier()  # the slot and p^T are rewritten by the next tiles
        async_copy.wait_group(0)

        if SUM_AT_END:
            l_i = gl.sum(l_acc, 0)
        else:
            l_i = l_acc
        empty = l_i == 0.0
        inv = kv_scale / gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        # the eight o^T tiles as one [HM, 512] tensor in model column order: each thread then holds 16 consecutive
        # columns of its rows (a relabelling of its registers), written as 16-byte stores
        o = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
        o = gl.reshape(o, [2, 2, 2, 2, 2, 2, HM, 2, 2, 2])  # w1 w0 rsel rlo2 rlo1 rlo0 | h | i0 i1 i2
        o = gl.reshape(gl.permute(o, (6, 0, 1, 3, 4, 5, 9, 8, 7, 2)), [HM, 512])  # d = 128w + 16·rlo + 2i + rsel
        o = gl.convert_layout(o, OUT_LAYOUT, assert_trivial=True)  # the 16 columns as the first registers
        OL: gl.constexpr = OUT_LAYOUT
        orow = gl.arange(0, HM, layout=gl.SliceLayout(1, OL))
        dcol = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, OL)), 0)
        o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, OL)), 1)
        if BALANCED:  # the result when the sequence has one program, else the partial of row (b·splits + split)·S_q + j
            part_start = (b * num_splits + gl.program_id(1)) * Q_PER_SEQ
            out_rows, oj, oh = _out_rows(orow, hb, q_start, 0, O, O_PART, stride_o_t, stride_o_h, stride_op_t,
                                         stride_op_h, 0, BLOCK_H, True)
            o_ok = gl.expand_dims((oj < Q_PER_SEQ) & (oh < H), 1)
            if programs == 1:
                gl.store(gl.expand_dims(out_rows, 1) + dcol, o.to(O.dtype.element_ty), mask=o_ok)
                gl.store(LSE + q_start.to(gl.int64) * stride_lse_t + rj * stride_lse_j + rh * stride_lse_h, lse,
                         mask=row_ok)
            else:
                part_rows, oj, oh = _out_rows(orow, hb, part_start, 0, O, O_PART, stride_o_t, stride_o_h,
                                              stride_op_t, stride_op_h, 0, BLOCK_H, False)
                gl.store(gl.expand_dims(part_rows, 1) + dcol, o, mask=o_ok)
                gl.store(LSE_PART + (part_start + rj).to(gl.int64) * stride_lp_t + rh * stride_lp_h, lse,
                         mask=row_ok)
        else:
            out_rows, oj, oh = _out_rows(orow, hb, q_start, split, O, O_PART, stride_o_t, stride_o_h, stride_op_t,
                                         stride_op_h, stride_op_s, BLOCK_H, FINAL)
            gl.store(gl.expand_dims(out_rows, 1) + dcol, o.to(out_rows.dtype.element_ty),
                     mask=gl.expand_dims((oj < Q_PER_SEQ) & (oh < H), 1))
            t = (q_start + rj).to(gl.int64)
            if FINAL:
                gl.store(LSE + q_start.to(gl.int64) * stride_lse_t + rj * stride_lse_j + rh * stride_lse_h, lse,
                         mask=row_ok)
            else:
                gl.store(LSE_PART + t * stride_lp_t + rh * stride_lp_h + split, lse, mask=row_ok)


STAGES = 2  # tiles in the cp.async ring: two programs per SM (3 or 4 stages leave one and were slower)
REGISTERS = 253  # per thread at HM 16, Triton 3.6; 255 on the balanced grid (the compile test pins 2 programs/SM)


@functools.lru_cache(maxsize=None)  # asked by every decode call that may take the balanced schedule
def programs_per_sm(hm: int, stages: int = STAGES) -> int:
    """Programs of the kernel one sm90 SM holds: its shared memory and four warps of REGISTERS decide."""
    return SM90.programs_per_sm(registers=REGISTERS, shared=shared_bytes(hm, stages), warps=4)["programs_per_sm"]


# per program, besides its share of the cache: the fp32 partial it writes, q and filling the ring (bytes-equivalent;
# B=64 at 16k then takes 4 splits, not 33 — the same waves, 8× the partials: 0.27 → 0.19 ms on an H200)
PROGRAM_OVERHEAD_BYTES = 100_000


@functools.lru_cache(maxsize=1024)  # asked by every decode call (each layer of an eager step): a search over ≤ 64
def auto_splits(batch: int, heads: int, q_len: int, capacity: int, sm_count: int, min_tokens: int = 256) -> int:
    """KV splits per sequence for a decode of `batch` sequences (pool capacity `capacity` tokens each): the count s
    that minimises ⌈batch·s / slots⌉ · (capacity·576 / s + PROGRAM_OVERHEAD_BYTES) — waves of programs times one
    program's bytes — with slots = programs per SM × SMs; the smallest s among equals; s ≤ 64 and ≤ capacity / 256."""
    slots = programs_per_sm(program_rows(heads, q_len)) * sm_count
    best, best_cost = 1, None
    for s in range(1, max(1, min(64, capacity // min_tokens)) + 1):
        cost = -(-batch * s // slots) * (capacity * 576 / s + PROGRAM_OVERHEAD_BYTES)
        if best_cost is None or cost < best_cost * (1 - 1e-9):
            best, best_cost = s, cost
    return best


def balanced_fits(batch: int, slots: int) -> bool:
    """Whether the balanced schedule can take `batch` sequences on `slots` program slots (one wave, every sequence
    at least one program, the tile counts summed in registers)."""
    return 0 < batch < slots and batch <= MAX_BALANCED_BATCH


def balanced_max_splits(batch: int, slots: int, capacity: int) -> int:
    """The balanced grid's programs per sequence (grid (batch, this)): BALANCED_SPLIT_FACTOR × slots / batch, so that
    a long sequence among short ones can take that many times its even share, at most 64 and the pool's tiles
    (capacity tokens) / MIN_SPAN_TILES. Programs past a sequence's count return at once (the grid's later CTAs:
    about a microsecond each of a program slot)."""
    return max(1, min(64, -(-capacity // (64 * MIN_SPAN_TILES)), BALANCED_SPLIT_FACTOR * slots // batch))


def balanced_schedule(seqlens: list[int], slots: int, max_splits: int = 64) -> list[int]:
    """Programs per sequence of the balanced schedule (what `_balanced_span` computes on the GPU, for tests and
    docs): sequence b of n_b = ⌈L_b / 64⌉ KV tiles gets min(max_splits, max(1, ⌈n_b / P⌉)) programs of ⌈n_b / s_b⌉
    tiles, P the even share ⌈Σ n_b / slots⌉ where that fits, else ⌈Σ n_b / (slots − B)⌉ (at least MIN_SPAN_TILES),
    so that the programs fit the slots in one wave."""
    n = [-(-int(x) // 64) for x in seqlens]
    per = max(MIN_SPAN_TILES, -(-sum(n) // slots))
    if sum(max(1, -(-k // per)) for k in n) > slots:
        per = max(MIN_SPAN_TILES, -(-sum(n) // (slots - len(n))))
    return [min(max_splits, max(1, -(-k // per))) for k in n]


def shared_bytes(hm: int, stages: int) -> int:
    """Shared memory of one program: the cp.async ring (36 KB a tile), q (9 groups of 64 columns) and p^T."""
    return stages * 576 * BLOCK_N + 10 * hm * 64 * 2


@functools.lru_cache(maxsize=None)
def out_layout(hm: int):
    """The epilogue's register layout of the output [HM, 512]: thread 32w + 4·rlo + q holds rows 2q + {0, 1} + 8j and
    the 16 columns 128w + 16·rlo … + 15, those columns as its first registers (16-byte stores)."""
    rows = [[1, 0], [8, 0]] + ([[16, 0]] if hm == 32 else [])
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + rows,
                                      lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
                                      warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[hm, 512])


def program_rows(heads: int, q_len: int) -> int:
    """HM: the wgmma N of a program holding heads × q_len rows (16 or 32)."""
    return max(16, triton.next_power_of_2(heads * q_len))


def launch(q3: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
           out3: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
           lse_strides: tuple[int, int, int], part_strides: tuple[int, int, int, int, int], qk_scale: float,
           kv_scale: float, kv_scale_ptr: torch.Tensor | None, *, q_per_seq: int, splits: int,
           stages: int = STAGES, meta: torch.Tensor | None = None, slots: int = 0) -> None:
    """Launch `_mla_fp8_decode` over grid (1, splits, B), or with `meta` the balanced schedule over grid (B, splits).

    q3: [B·S_q, H, 576] bf16/fp16 queries (H·S_q ≤ 32); kv_cache: [P, page, 576] uint8 e4m3 bytes; block_table
    [B, max_pages] int32; seqlens [B] int32; out3 [B·S_q, H, 512] (written with splits == 1), lse through
    lse_strides; with splits > 1 the fp32 partials o_part [B·S_q, H, splits, 512] and lse_part [B·S_q, H, splits]
    (part_strides: o_part's three, lse_part's two). qk_scale: softmax scale · log2(e); kv_scale: the pool's scale,
    or read from kv_scale_ptr [1] fp32 when given. stages: tiles of the cp.async ring (2: two programs per SM).
    Balanced (`balanced_schedule`, grid (B, splits) with splits = `balanced_max_splits`): meta [B, 2] int32
    receives (first partial row group, programs) per sequence; a sequence with one program gets its result in out3
    and lse, the others partials in o_part [B, splits, S_q, H, 512] and lse_part [B, splits, S_q, H] (row
    (b·splits + split)·S_q + j; part_strides then (o_part's two, 0, lse_part's two)), which `_mla_combine` merges
    over each sequence's count."""
    T, H, _ = q3.shape
    B = seqlens.shape[0]
    hm = program_rows(H, q_per_seq)
    if H * q_per_seq > MAX_ROWS:
        raise ValueError(f"mla gluon: {H} heads × S_q {q_per_seq} exceed the {MAX_ROWS} rows one program holds")
    if q3.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("mla gluon: q and the cache need contiguous last dimensions")
    smem = shared_bytes(hm, stages)
    if smem > SM90.shared_per_program:
        raise ValueError(f"mla gluon: {stages} ring stages at {hm} query rows need {smem} bytes of shared memory, "
                         f"more than an sm90 program gets ({SM90.shared_per_program})")
    from_ptr = kv_scale_ptr is not None
    balanced = meta is not None
    if balanced and not balanced_fits(B, slots):
        raise ValueError(f"mla gluon: the balanced schedule needs fewer sequences ({B}) than program slots "
                         f"({slots}) and at most {MAX_BALANCED_BATCH}")
    grid = (B, splits) if balanced else (1, splits, B)
    _mla_fp8_decode[grid](
        q3, kv_cache, block_table, seqlens, out3, lse, o_part, lse_part, meta if balanced else seqlens, kv_scale,
        kv_scale_ptr if from_ptr else seqlens, qk_scale,
        q3.stride(0), q3.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out3.stride(0), out3.stride(1), *lse_strides, *part_strides, H, splits, B, slots,
        Q_PER_SEQ=q_per_seq, BLOCK_H=H, HM=hm, PAGE=kv_cache.shape[1], STAGES=stages,
        FINAL=not balanced and splits == 1, SCALE_FROM_PTR=from_ptr, OUT_LAYOUT=out_layout(hm), BALANCED=balanced,
        BLOCK_B=max(128, triton.next_power_of_2(B)), num_warps=4)
