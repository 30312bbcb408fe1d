"""fp8 MLA decode for Hopper (sm90) in Gluon: the cache bytes stream through a cp.async ring in shared memory, q·k
runs on them as e4m3 × e4m3 wgmma, and each thread converts only the bytes of its own V^T fragments.

Why: the Triton kernels of triton_kernels.py upcast an fp8 tile in registers and hand it to `tl.dot`, which stages
it through shared memory again; with few heads per program that tile work, not HBM, bounds them (an fp8 pool was
slower than a bf16 one at 16 heads: bench/results/NVIDIA_H200/attention). Here one program (one warpgroup, two per
SM) holds every query row of a sequence (heads × S_q ≤ 32, padded to HM = 16 or 32) and walks one split of its KV
range in tiles of 64 tokens, token-major ("swap AB"), so the tile's tokens are the wgmma's M side:

- cp.async ring of two tiles (32 KB of the 512 latent columns as four [64, 128] blocks in the 128-byte swizzle, and
  4 KB of the 64 rope columns in the 64-byte one: wgmma's own operand layouts). Thread 32w + 8t + 4l + c copies
  tokens 16w + t + 4l + 8j (j < 2), pieces c and c + 4 of each block and rope piece c: the latent copies and the
  V^T reads below are free of bank conflicts (the rope copies, 2 of 18, are 2-way). The next tile is in flight
  while one is computed.
- q: each row scaled by a power of two into (128, 256] and split into QPARTS e4m3 parts whose sum is the row exactly
  (bf16: two, fp16: four; `q_parts_reference`), stored as the B operand [QPARTS·HM, 576].
- s^T [64, QPARTS·HM] = K · q_parts^T: e4m3 × e4m3 wgmma with both operands in shared memory (no conversion, no
  register fragments), one accumulator per 128-column block (QK_CHAINS) added in fp32 — fp8 wgmma accumulates in
  fewer bits than fp32 — and the parts of each row added.
- Online softmax over the tile (base 2, scores scaled by softmax scale · kv_scale · q's per-row power of two; the
  mask only on tiles that reach the split end or the causal rows), p^T to shared memory as fp16. Lazy rescaling:
  the running max moves, and o and the row sums are rescaled, only when some row's max grew by more than
  RESCALE_LOG2 (p then stays ≤ 2^8); the row sums are kept per (token slot, row) and reduced once at the end.
- o^T [512, HM] += V^T · p^T as eight fp16 [64, HM] accumulators, V^T's A fragments read from the tile
  (`NOPE_VIEW_BASES`) with the rows of o^T permuted (row r = 16w + 8·rsel + rlo of accumulator i is latent column
  128w + 16·rlo + 2i + rsel): a thread's fragments are 16 consecutive bytes of each of its 16 tokens, one 16-byte
  shared load each, converted (`cvt.rn.f16x2.e4m3x2`) with one byte permute per register.
- The result and lse, or per-split fp32 partials that triton_kernels' `_mla_combine` merges (the output contract of
  `_mla_fwd`); the output is relabelled so that each thread writes 16 consecutive columns per row.

Per tile three barriers of the kernel's own (the tile's copies landed; p^T written; the slot read) and the softmax's
cross-warp max. Rows of the tile at positions ≥ the split end are not loaded (the cp.async zero-fills them), so
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
    _REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - reported by `available()`
    HAVE_GLUON = False

BLOCK_N = 64  # tokens per tile: the wgmma M of one warpgroup
STAGES = 2  # tiles in the cp.async ring: two programs per SM (3 or 4 stages leave one and were slower)
# the latent tile [64 tokens, 512 bytes] as wgmma reads it — four [64, 128] column blocks, 8192 bytes apart, each
# in the 128-byte swizzle (16-byte piece p of row τ at piece p ^ (τ % 8)) — seen as one tile: the (token, column)
# of each bit of a byte's offset (bits 0–6 the column in its block, 7–12 the token, 13–14 the block)
NOPE_VIEW_BASES = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64],
                   [1, 16], [2, 32], [4, 64], [8, 0], [16, 0], [32, 0], [0, 128], [0, 256]]
QPARTS_OF = {torch.bfloat16: 2, torch.float16: 4}  # e4m3 parts that hold a query element exactly (`_q_parts`)
# the q·k MMA's accumulators per tile, by its N (query rows × parts): one per column block (5) where registers
# allow, else two. fp8 wgmma adds into its accumulator in fewer bits than fp32: with one accumulator for all 576
# columns the cosine error reached 1.9e-5 on the GPU tests' growing scores, with 5 (N 32) 7e-7, with 2 (N 64)
# 3.4e-6 (bench/results/NVIDIA_H200/attention/2026-12-01_fp8_qk)
QK_CHAINS = {32: 5, 64: 2, 128: 2}
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


def q_parts_reference(x: torch.Tensor, parts: int) -> torch.Tensor:
    """The arithmetic of the kernel's `_q_parts` in torch (tests, docs). x: [..] fp32, |x| ≤ 256 (a query row scaled
    by its power of two). Returns [parts, ..] fp32, each part an e4m3 value: part k is the e4m3 value (to nearest
    even; 0 below e4m3's normal range 2^-6) of what the parts before leave of x, the last the e4m3 conversion of the
    rest. Their sum is x exactly when x has at most 4·parts significant bits (bf16 values: 2 parts, fp16: 4) and
    the last part lies on e4m3's grid (|x| ≥ 2^-2 for bf16, ≥ 2 for fp16), else within 2^-10 of it."""
    def value(v):  # e4m3's nearest value by integer rounding of the fp32 bits (the kernel's `_e4m3_value`)
        bits = v.contiguous().view(torch.int32)
        bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -1048576
        return torch.where(v.abs() < 2.0 ** -6, torch.zeros_like(v), bits.view(torch.float32))

    out, rest = [], x.float()
    for _ in range(parts - 1):
        out.append(value(rest))
        rest = rest - out[-1]
    out.append(rest.to(torch.float8_e4m3fn).float())
    return torch.stack(out)


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
    _STAGES = gl.constexpr(STAGES)
    _MIN_SPAN_TILES = gl.constexpr(MIN_SPAN_TILES)
    _NOPE_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=NOPE_VIEW_BASES))
    _BLK = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    _PE_BLK = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
    # the copies: thread 32w + 8·t + 4·l + c (lane bits c: two, l, t: two) copies tokens 16w + t + 4·l + 8j (j < 2),
    # pieces c, c + 4 of each 128-column block; rope piece c of the same tokens
    _CPL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 64], [0, 128], [0, 256], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [4, 0], [1, 0], [2, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 512]))
    _PCL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [4, 0], [1, 0], [2, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 64]))
    # V^T's A fragments: tokens 2q + c + 8·t3 + 16·kk, columns 128w + 16·rlo … + 15 (d permuted, `_pv_tiles`)
    _PVL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[[0, 128], [0, 256]],
        block_bases=[], shape=[64, 512]))
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
    def _e4m3_value(x):
        """x [..] fp32 rounded (to nearest even) to e4m3's 4 significant bits, as fp32, by integer arithmetic on the
        bits; 0 below e4m3's normal range (2^-6), whose values the next part takes."""
        bits = x.to(gl.int32, bitcast=True)
        bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -1048576
        return gl.where(gl.abs(x) < 0.015625, 0.0, bits.to(gl.float32, bitcast=True))

    @gluon.jit
    def _q_parts(x, QPARTS: gl.constexpr):
        """x [R, W] fp32 (|x| ≤ 256) → [QPARTS·R, W] e4m3, row p·R + r part p of row r: each part the e4m3 value of
        what the parts before leave of x, so Σ_p parts = x exactly where x has at most 4·QPARTS significant bits
        (bf16: 2 parts, fp16: 4) and its last part lies above e4m3's subnormal step 2^-9 (else it is rounded there).
        The parts are formed in fp32 (`_e4m3_value`); only the results are converted."""
        p0 = _e4m3_value(x)
        r = x - p0
        if QPARTS == 2:
            y = gl.permute(gl.join(p0.to(gl.float8e4nv), r.to(gl.float8e4nv)), (2, 0, 1))
        else:
            p1 = _e4m3_value(r)
            r = r - p1
            p2 = _e4m3_value(r)
            r = r - p2
            y = gl.join(gl.join(p0.to(gl.float8e4nv), p1.to(gl.float8e4nv)),
                        gl.join(p2.to(gl.float8e4nv), r.to(gl.float8e4nv)))
            y = gl.permute(y, (3, 2, 0, 1))
        return gl.reshape(y, [QPARTS * x.shape[0], x.shape[1]])

    @gluon.jit
    def _sum_parts(s, QPARTS: gl.constexpr, HM: gl.constexpr):
        """s^T [64, QPARTS·HM] (column p·HM + r: the scores of row r against q's part p) → [64, HM], their sum."""
        if QPARTS == 2:
            a, b = gl.split(gl.permute(gl.reshape(s, [64, 2, HM]), (0, 2, 1)))
            return a + b
        else:
            x0, x1 = gl.split(gl.permute(gl.reshape(s, [64, 2, 2, HM]), (0, 3, 1, 2)))  # parts 2b + a: a = 0, 1
            b0, b1 = gl.split(x0 + x1)
            return b0 + b1

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
    def _viewed(ring, slot, shape: gl.constexpr, layout: gl.constexpr):
        """Ring slot `slot` of `ring` seen as uint8 of `shape` [STAGES, ...] in `layout` (Triton 3.6 names the view
        `_reinterpret`, later ones `reinterpret`)."""
        if _REINTERPRET_PUBLIC:
            return ring.reinterpret(gl.uint8, shape, layout).index(slot)
        else:
            return ring._reinterpret(gl.uint8, shape, layout).index(slot)

    @gluon.jit
    def _bytes(nope, slot):
        """Ring slot `slot` of latent blocks `nope` [STAGES·4, 64, 128] e4m3 as one [64, 512] byte tile."""
        return _viewed(nope, slot, [_STAGES, 64, 512], _NOPE_VIEW)

    @gluon.jit
    def _pe_bytes(pe, slot):
        """Ring slot `slot` of rope blocks `pe` [STAGES, 64, 64] e4m3 as bytes."""
        return _viewed(pe, slot, [_STAGES, 64, 64], _PE_BLK)

    @gluon.jit
    def _issue(nope, pe, slot, KV, start, hi, page, tau, col_n, col_p, stride_kv_p, stride_kv_o, PAGE: gl.constexpr):
        """cp.async of the tile at `start` into a ring slot (latent blocks `nope`, rope block `pe`; rows at or past hi
        are zero-filled, not read), its page ids read a tile earlier: each thread copies 16 of the latent columns'
        16-byte pieces (tokens 16w + t + 4·l + 8j, j < 2; 8 pieces of each) and one rope piece of each of them."""
        row, ok = _rows(page, start, hi, tau, stride_kv_p, stride_kv_o, PAGE)
        _cp_async(_bytes(nope, slot), KV + row + col_n, mask=ok)
        _cp_async(_pe_bytes(pe, slot),
                  KV + 512 + gl.convert_layout(row, _PCL) + col_p, mask=gl.convert_layout(ok, _PCL))
        async_copy.commit_group()

    @gluon.jit
    def _landed(x):
        """cp.async.wait_group 0 and fence.proxy.async.shared::cta in every thread (x: an int32 tensor of one
        element per thread): this thread's copies have landed, and they (generic proxy) are visible to wgmma's reads
        (async proxy). Inline assembly, so that Triton's barrier analysis adds no barrier of its own between the two:
        the caller's follows."""
        return gl.inline_asm_elementwise("cp.async.wait_group 0; fence.proxy.async.shared::cta; mov.b32 $0, $1;",
                                         "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

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
    def _qk_mma(k_smem, q_smem, s, use_acc: gl.constexpr):
        """Issue s^T (+)= K·q^T for one column block: K [64, W] and q's parts [NQ, W], e4m3 in shared memory."""
        return warpgroup_mma(k_smem, q_smem.permute((1, 0)), s, use_acc=use_acc, is_async=True)

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
                        FINAL: gl.constexpr, SCALE_FROM_PTR: gl.constexpr,
                        OUT_LAYOUT: gl.constexpr, BALANCED: gl.constexpr, BLOCK_B: gl.constexpr,
                        QPARTS: gl.constexpr, CHAINS: gl.constexpr):
        """Grid (head blocks, splits, batch), or with BALANCED (batch, num_splits) (`_balanced_span`; partials then
        in rows (b · num_splits + split) · S_q + j). Program rows r < HM: query token j = r // BLOCK_H of the
        sequence, head hb·BLOCK_H + r % BLOCK_H; module docstring for the rest."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        NQ: gl.constexpr = QPARTS * HM  # the q·k MMA's N: every part of every row
        SMMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 32])
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HM, 64], gl.float16)
        QW: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # q's [HM, 128] blocks
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # q_pe [HM, 64]
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

        # ---- the ring: per slot four [64, 128] latent column blocks and the [64, 64] rope block, in wgmma's
        # swizzles (the copies and V^T see the latent blocks as one [64, 512] byte tile, NOPE_VIEW_BASES)
        nope_r = gl.allocate_shared_memory(gl.float8e4nv, [_STAGES * 4, 64, 128], _BLK)
        pe_r = gl.allocate_shared_memory(gl.float8e4nv, [_STAGES, 64, 64], _PE_BLK)
        tau = gl.arange(0, 64, layout=gl.SliceLayout(1, _CPL))
        col_n = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, _CPL)), 0)
        col_p = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, _PCL)), 0)
        bt_row = BT + b.to(gl.int64) * stride_bt_b
        _issue(nope_r, pe_r, 0, KV, lo, hi, _pages(bt_row, lo, hi, tau, PAGE), tau, col_n, col_p,
               stride_kv_p, stride_kv_o, PAGE)  # the first tile in flight
        page = _pages(bt_row, lo + 64, hi, tau, PAGE)

        # ---- q: rows scaled by a power of two into (128, 256], split into QPARTS e4m3 parts (exact), into shared
        # memory as the q·k MMA's B operand [NQ, 576] in four 128-column blocks and the rope block
        qr = gl.arange(0, HM, layout=gl.SliceLayout(1, QW))
        qj = qr // BLOCK_H
        qh = hb * BLOCK_H + qr % BLOCK_H
        q_ok = gl.expand_dims((qj < Q_PER_SEQ) & (qh < H), 1)
        q_row = Q + gl.expand_dims((q_start + qj).to(gl.int64) * stride_q_t + qh * stride_q_h, 1)
        kw = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QW)), 0)
        qpr = gl.arange(0, HM, layout=gl.SliceLayout(1, QL))
        qpj = qpr // BLOCK_H
        qph = hb * BLOCK_H + qpr % BLOCK_H
        qp_ok = gl.expand_dims((qpj < Q_PER_SEQ) & (qph < H), 1)
        qp_row = Q + gl.expand_dims((q_start + qpj).to(gl.int64) * stride_q_t + qph * stride_q_h, 1) + 512
        kp = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
        qpe = gl.load(qp_row + kp, mask=qp_ok, other=0.0).to(gl.float32)
        amax = gl.convert_layout(gl.max(gl.abs(qpe), 1), gl.SliceLayout(1, QW))
        for c in gl.static_range(4):
            qc = gl.load(q_row + c * 128 + kw, mask=q_ok, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(qc), 1))
        qfac = gl.exp2(gl.ceil(gl.log2(gl.maximum(amax, 1e-30) * (1.0 / 256.0))))
        inv_f = gl.expand_dims(1.0 / qfac, 1)
        qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, NQ, 128], _BLK)
        for c in gl.static_range(4):
            qc = gl.load(q_row + c * 128 + kw, mask=q_ok, other=0.0).to(gl.float32)
            qn_smem.index(c).store(_q_parts(qc * inv_f, QPARTS))
        qp_smem = gl.allocate_shared_memory(gl.float8e4nv, [NQ, 64], _PE_BLK)
        qp_smem.store(_q_parts(qpe * gl.expand_dims(gl.convert_layout(1.0 / qfac, gl.SliceLayout(1, QL)), 1), QPARTS))

        r = gl.arange(0, HM, layout=ROWS)
        rj = r // BLOCK_H
        rh = hb * BLOCK_H + r % BLOCK_H
        row_ok = (rj < Q_PER_SEQ) & (rh < H)
        limit = prefix + rj + 1  # row r sees positions < limit
        row_scale = qk_scale * kv_scale * gl.convert_layout(qfac, ROWS)
        p_smem = gl.allocate_shared_memory(gl.float16, [HM, 64], QS)

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
        fence_x = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        n_tiles = gl.cdiv(hi - lo, 64)
        for i in range(n_tiles):
            start = lo + i * 64
            slot = i % _STAGES
            # this tile's copies landed in this thread (and are fenced for wgmma) before the next tile goes in flight
            # (its slot's readers passed the barrier ending the tile before; its page ids were read a tile ago): the
            # fence's memory barrier then has no copy of the next tile to wait for
            _landed(fence_x)
            _issue(nope_r, pe_r, (i + 1) % _STAGES, KV, start + 64, hi, page, tau, col_n, col_p, stride_kv_p,
                   stride_kv_o, PAGE)
            page = _pages(bt_row, start + 128, hi, tau, PAGE)
            _cta_barrier()  # every thread's copies of the tile have landed (and q's stores)

            # s^T = K·q^T: e4m3 × e4m3 from shared memory, every part of q at once
            z = gl.zeros([64, NQ], gl.float32, layout=SMMA)
            # fp8 wgmma adds into its accumulator in fewer bits than fp32 (relative 2^-12 of the scores over the
            # 576 columns in one chain): the blocks go to CHAINS accumulators, added in fp32
            if CHAINS == 2:  # latent blocks 0-1, and 2-3 with the rope block
                s0 = _qk_mma(nope_r.index(4 * slot), qn_smem.index(0), z, False)
                s0 = _qk_mma(nope_r.index(4 * slot + 1), qn_smem.index(1), s0, True)
                s1 = _qk_mma(nope_r.index(4 * slot + 2), qn_smem.index(2), z, False)
                s1 = _qk_mma(nope_r.index(4 * slot + 3), qn_smem.index(3), s1, True)
                s1 = _qk_mma(pe_r.index(slot), qp_smem, s1, True)
                s0, s1 = warpgroup_mma_wait(0, deps=(s0, s1))
                s = s0 + s1
            else:  # one per block
                s0 = _qk_mma(nope_r.index(4 * slot), qn_smem.index(0), z, False)
                s1 = _qk_mma(nope_r.index(4 * slot + 1), qn_smem.index(1), z, False)
                s2 = _qk_mma(nope_r.index(4 * slot + 2), qn_smem.index(2), z, False)
                s3 = _qk_mma(nope_r.index(4 * slot + 3), qn_smem.index(3), z, False)
                s4 = _qk_mma(pe_r.index(slot), qp_smem, z, False)
                s0, s1, s2, s3, s4 = warpgroup_mma_wait(0, deps=(s0, s1, s2, s3, s4))
                s = ((s0 + s1) + (s2 + s3)) + s4
            s = gl.convert_layout(_sum_parts(s, QPARTS, HM), MMA, assert_trivial=True)

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
            _cta_barrier()  # p^T written

            # o^T += V^T·p^T, V^T's fragments read from the whole tile
            v0, v1, v2, v3, v4, v5, v6, v7 = _pv_tiles(_bytes(nope_r, slot).load(_PVL))
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
            _cta_barrier()  # every warp is done with the slot (the next tile's copies rewrite it) and p^T
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


REGISTERS = 241  # per thread at HM 16 with bf16 queries, Triton 3.6 (the compile test pins 2 programs/SM)


@functools.lru_cache(maxsize=None)  # asked by every decode call that may take the balanced schedule
def programs_per_sm(hm: int, qparts: int = 2) -> int:
    """Programs of the kernel one sm90 SM holds at HM rows and q in `qparts` e4m3 parts (QPARTS_OF): its shared
    memory and four warps of REGISTERS decide."""
    return SM90.programs_per_sm(registers=REGISTERS, shared=shared_bytes(hm, qparts), warps=4)["programs_per_sm"]


# per program, besides its share of the cache: the fp32 partial it writes, q and filling the ring (bytes-equivalent;
# B=64 at 16k then takes 4 splits, not 33 — the same waves, 8× the partials: 0.27 → 0.19 ms on an H200)
PROGRAM_OVERHEAD_BYTES = 100_000


@functools.lru_cache(maxsize=1024)  # asked by every decode call (each layer of an eager step): a search over ≤ 64
def auto_splits(batch: int, heads: int, q_len: int, capacity: int, sm_count: int, min_tokens: int = 256,
                qparts: int = 2) -> int:
    """KV splits per sequence for a decode of `batch` sequences (pool capacity `capacity` tokens each): the count s
    that minimises ⌈batch·s / slots⌉ · (capacity·576 / s + PROGRAM_OVERHEAD_BYTES) — waves of programs times one
    program's bytes — with slots = programs per SM × SMs; the smallest s among equals; s ≤ 64 and ≤ capacity / 256."""
    slots = programs_per_sm(program_rows(heads, q_len), qparts) * sm_count
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


def shared_bytes(hm: int, qparts: int = 2) -> int:
    """Shared memory of one program: the cp.async ring (STAGES tiles of 36 KB), q's e4m3 parts [qparts·hm, 576] and
    p^T."""
    return STAGES * 576 * BLOCK_N + qparts * hm * 576 + hm * 64 * 2


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
           meta: torch.Tensor | None = None, slots: int = 0) -> None:
    """Launch `_mla_fp8_decode` over grid (1, splits, B), or with `meta` the balanced schedule over grid (B, splits).

    q3: [B·S_q, H, 576] bf16/fp16 queries (H·S_q ≤ 32); kv_cache: [P, page, 576] uint8 e4m3 bytes; block_table
    [B, max_pages] int32; seqlens [B] int32; out3 [B·S_q, H, 512] (written with splits == 1), lse through
    lse_strides; with splits > 1 the fp32 partials o_part [B·S_q, H, splits, 512] and lse_part [B·S_q, H, splits]
    (part_strides: o_part's three, lse_part's two). qk_scale: softmax scale · log2(e); kv_scale: the pool's scale,
    or read from kv_scale_ptr [1] fp32 when given.
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
    if q3.dtype not in QPARTS_OF:
        raise ValueError(f"mla gluon: queries of {q3.dtype} are not taken (bf16 or fp16; fp32 is the oracle's)")
    qparts = QPARTS_OF[q3.dtype]
    smem = shared_bytes(hm, qparts)
    if smem > SM90.shared_per_program:
        raise ValueError(f"mla gluon: {hm} query rows need {smem} bytes of shared memory, "
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
        Q_PER_SEQ=q_per_seq, BLOCK_H=H, HM=hm, PAGE=kv_cache.shape[1],
        FINAL=not balanced and splits == 1, SCALE_FROM_PTR=from_ptr, OUT_LAYOUT=out_layout(hm), BALANCED=balanced,
        BLOCK_B=max(128, triton.next_power_of_2(B)), QPARTS=qparts, CHAINS=QK_CHAINS[qparts * hm], num_warps=4)
