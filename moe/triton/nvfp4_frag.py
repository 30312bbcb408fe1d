"""NVFP4 W4A16 decode GEMM for Hopper (sm90) in Gluon: weights repacked in wgmma fragment order.

Why: the Triton kernel of nvfp4_moe.py stages the weight bytes through shared memory and pairs each byte's two
unpacked nibbles into one register with byte permutes before the MMA: ~3.7 instructions per weight element at
EP4 decode, where the GEMM is bound by its instruction stream, not by HBM
(bench/results/NVIDIA_H200/moe_experts/2026-12-01_stalls). Here each thread loads exactly the bytes of its own
wgmma A fragments (four 16-byte loads per 128×128 tile), unpacks them in registers with the DEQ_ASM sequence and
hands them to wgmma as the register A operand: no permutes. The bytes come straight from global memory, or (W_STAGES;
the runner's default for gate_up, and for the down GEMM when it pairs N tiles) through a cp.async ring in shared
memory in which each thread copies and reads back only its own fragments, so that several tiles are in flight per
program without holding registers. With X_RING (the runner's default with a ring) each slot also holds the K tile's
activations [BM, 128], copied in the same group and read by wgmma where they land: loaded into registers at each
step instead, every K step waited for one L2 round trip. PDL (off by default) launches the GEMMs with programmatic
dependent launch: a program issues its first weight copies before it waits for the kernel that wrote its input.
MMA_ASYNC (with X_RING; the runner's default for 16- and 32-token programs with more than one token expected per
expert) cuts each tile into its two 64-row halves, each with its own accumulator, and issues their MMAs
asynchronously: a half is unpacked while the previous half's MMA runs, instead of one synchronous MMA per tile after
its whole unpack (and 16-token programs need 122 registers instead of 155).

Layouts (one program = 128 weight rows × all of K, one warpgroup; tile = 128 rows × 128 K):

- wgmma A fragment (DotOperandLayout k_width 2 of an m64nBMk16 MMA): thread t = 32w + l holds rows
  16w + l//4 (+8, +64, +72) and, per 16-wide MMA k step c, k = 2q, 2q+1, 2q+8, 2q+9 (q = l % 4).
- MMA K order: the tile's model column k' = 32q + 4c + 2n + u is MMA column 16c + 8n + 2q + u (`perm_k`), so that
  a thread's 32 columns of a row are 32 consecutive model columns: two NVFP4 scale blocks per row, not eight.
- Packed byte i of thread t (i = u + 2·rsel + 4·c + 32·rhi): row 16w + l//4 + 8·rsel + 64·rhi; low nibble = MMA
  column 16c + 2q + u, high nibble = that + 8 (model columns 32q + 4c + u and + 2). Bytes 16·(i//16) … of all
  128 threads are contiguous (`pack_weights`): a warp's 16-byte loads cover 512 consecutive bytes.
- Scales: thread t's 8 bytes (rsel + 2·c2 + 4·rhi; c2 = c // 4) contiguous (`pack_scales`).
- Activations: `_prep_x` writes the valid rows as fp16 ·2^-8 (alpha ·256) in MMA K order (a few µs; converting
  in the gate_up kernel itself cost it registers and a program per SM); the gate_up program writes the
  intermediate the same way for the down GEMM, which reads it as it is.

The values: nibble → e4m3 byte → `cvt.rn.f16x2.e4m3x2` = value·2^-6, times the block scale (exact in fp16),
per-expert alpha = weight_scale_2 · 2^6 · 2^8 in the fp32 epilogue.

Both dispatch layouts: a Masked slab's programs are (N tile, expert, token block); Contiguous rows are cut into
per-expert token blocks (`block_schedule`) and a program finds its expert by comparing its block with the
experts' first blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdlab.kernels.arch import wgmma_unavailable
from pdlab.moe.triton.nvfp4_moe import deq_ptx, listed_block, max_blocks, slab_blocks

try:  # Gluon (Triton ≥ 3.5): explicit layouts
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    # the CTA barrier: gl.thread_barrier up to Triton 3.6, gl.barrier after; the cp.async copy:
    # async_copy_global_to_shared up to 3.6, async_load after
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - reported by `available()`
    HAVE_GLUON = False

TILE = 128


def perm_k(device=None) -> torch.Tensor:
    """[128] int64: the model column (within a 128-column tile) of each MMA column:
    16c + 8n + 2q + u ↦ 32q + 4c + 2n + u."""
    mk = torch.arange(TILE, device=device)
    c, n, q, u = mk // 16, (mk // 8) % 2, (mk // 2) % 4, mk % 2
    return 32 * q + 4 * c + 2 * n + u


def _thread_index(device=None):
    """(row offset within the tile, MMA k of the low nibble) of packed byte (i16, t, b): tensors [4, 128, 16]."""
    i16 = torch.arange(4, device=device)[:, None, None]
    t = torch.arange(TILE, device=device)[None, :, None]
    b = torch.arange(16, device=device)[None, None, :]
    i = i16 * 16 + b
    u, rsel, c, rhi = i % 2, (i // 2) % 2, (i // 4) % 8, i // 32
    w, lane = t // 32, t % 32
    q, rlo = lane % 4, lane // 4
    row = 16 * w + rlo + 8 * rsel + 64 * rhi
    return row, 16 * c + 2 * q + u


def pack_weights(w: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """NVFP4 bytes [E, N, K/2] uint8 (modelopt layout: low nibble = even column) → [E, N/128, K/128, 4, 128, 16]
    uint8 in fragment order (module docstring). N and K multiples of 128. Works `chunk` experts at a time (its
    transient memory is ~4× those experts' bytes)."""
    E, N, KH = w.shape
    K = 2 * KH
    if N % TILE or K % TILE:
        raise ValueError(f"pack_weights: N={N} and K={K} must be multiples of {TILE}")
    row, mk_lo = _thread_index(w.device)
    pk = perm_k(w.device)
    k_lo, k_hi = pk[mk_lo], pk[mk_lo + 8]  # model columns within the tile, [4, 128, 16]
    out = torch.empty(E, N // TILE, K // TILE, 4, TILE, 16, dtype=torch.uint8, device=w.device)
    for e0 in range(0, E, chunk):
        part = w[e0:e0 + chunk]
        n = part.shape[0]
        tiles = part.reshape(n, N // TILE, TILE, K // TILE, TILE // 2).permute(0, 1, 3, 2, 4)  # [n, NT, KT, 128, 64]
        nib = torch.stack([tiles & 0xF, tiles >> 4], dim=-1).reshape(n, N // TILE, K // TILE, TILE, TILE)
        out[e0:e0 + n] = nib[:, :, :, row, k_lo] | (nib[:, :, :, row, k_hi] << 4)
    return out


def _scale_index(device=None):
    """(row within the tile, scale block within the tile) of thread t's scale byte s: tensors [128, 8]."""
    t = torch.arange(TILE, device=device)[:, None]
    s = torch.arange(8, device=device)[None, :]
    rsel, c2, rhi = s % 2, (s // 2) % 2, s // 4
    w, lane = t // 32, t % 32
    return 16 * w + lane // 4 + 8 * rsel + 64 * rhi, 2 * (lane % 4) + c2


def pack_scales(sf: torch.Tensor) -> torch.Tensor:
    """Block scales [E, N, K/16] (e4m3 bytes) → [E, N/128, K/128, 128, 8] uint8: thread t's 8 scales, byte
    rsel + 2·c2 + 4·rhi = row 16w + l//4 + 8·rsel + 64·rhi, block 2q + c2 of the tile."""
    E, N, KB = sf.shape
    sf = sf.view(torch.uint8) if sf.dtype != torch.uint8 else sf
    row, blk = _scale_index(sf.device)
    tiles = sf.reshape(E, N // TILE, TILE, KB // 8, 8).permute(0, 1, 3, 2, 4)  # [E, NT, KT, 128 rows, 8 blocks]
    return tiles[:, :, :, row, blk].contiguous()


def unpack_weights(wp: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_weights` (tests): [E, NT, KT, 4, 128, 16] → [E, N, K/2] uint8."""
    E, NT, KT = wp.shape[:3]
    row, mk_lo = _thread_index(wp.device)
    pk = perm_k(wp.device)
    nib = torch.zeros(E, NT, KT, TILE, TILE, dtype=torch.uint8, device=wp.device)
    nib[:, :, :, row, pk[mk_lo]] = wp & 0xF
    nib[:, :, :, row, pk[mk_lo + 8]] = wp >> 4
    nib = nib.reshape(E, NT, KT, TILE, TILE // 2, 2)
    byte = nib[..., 0] | (nib[..., 1] << 4)
    return byte.permute(0, 1, 3, 2, 4).reshape(E, NT * TILE, KT * TILE // 2).contiguous()


def unpack_scales(sp: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_scales`: [E, NT, KT, 128, 8] → [E, N, K/16] uint8."""
    E, NT, KT = sp.shape[:3]
    row, blk = _scale_index(sp.device)
    tiles = torch.empty(E, NT, KT, TILE, 8, dtype=torch.uint8, device=sp.device)
    tiles[:, :, :, row, blk] = sp
    return tiles.permute(0, 1, 3, 2, 4).reshape(E, NT * TILE, KT * 8).contiguous()


def column_order(K: int, device=None) -> torch.Tensor:
    """[K] int64: the model column of each MMA column over K (tile by tile)."""
    return (torch.arange(0, K, TILE, device=device)[:, None] + perm_k(device)[None, :]).reshape(-1)


@triton.jit
def _prep_x(X, SF, GS, Y, CNT, M, K, stride_xe, stride_xm, stride_se, stride_sm, x_scale,
            KIND: tl.constexpr, GS_PER_EXPERT: tl.constexpr, BLOCK: tl.constexpr, ALL_ROWS: tl.constexpr = False,
            PERMUTE: tl.constexpr = True, PDL: tl.constexpr = False, NUM_E=0, BM: tl.constexpr = 0,
            E_POW2: tl.constexpr = 128):
    """Y[e, m, kb·128 + mk] = fp16(value of model column kb·128 + perm_k(mk) of X[e, m] · 2^-8) for m < CNT[e]
    (every row with ALL_ROWS); grid (E·M, K/BLOCK), or with BM > 0 (the block list of `frag_gemm`: expert e owns
    ⌈CNT[e] / BM⌉ blocks of BM rows, experts in order, NUM_E experts, E_POW2 ≥ NUM_E a power of two) grid
    (blocks·BM, K/BLOCK), program i row i % BM of block i // BM. KIND 0: float X; 1: fp8 bytes, SF fp32 per 128
    columns; 2: nvfp4 bytes (low nibble = even column), SF e4m3 bytes per 16 columns, value = e2m1 · SF / GS.
    PERMUTE: the values are read in model order (contiguous) and reordered in registers (a tile's model column
    32q + 4c + 2n + u is element (q, c, n, u) of a [4, 8, 2, 2] block, its MMA column that of (c, n, q, u));
    else each MMA column gathers its model column from memory. x_scale: 2^-8, a run-time value on purpose: with the
    constant, LLVM rewrites fp16(fp32(x) · 2^-8) as fp16(x) · 2^-8, which overflows from |x| = 65520.
    PDL: let the next kernel (the gate_up GEMM, launched with programmatic dependent launch) start at once; it
    waits for this grid's completion before it reads Y."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if BM > 0:
        i = tl.program_id(0)
        e, m0, count = listed_block(CNT, i // BM, NUM_E, BM, E_POW2)
        m = m0 + i % BM
        em = e * M + m
    else:
        em = tl.program_id(0)
        e = em // M
        m = em % M
        if ALL_ROWS:
            count = M
        else:
            count = tl.load(CNT + e)
    if m < count:
        mk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if PERMUTE:
            src = mk
        else:
            t = mk % 128
            src = (mk - t) + 32 * ((t // 2) % 4) + 4 * (t // 16) + 2 * ((t // 8) % 2) + t % 2
        row = X + e.to(tl.int64) * stride_xe + m * stride_xm
        srow = SF + e.to(tl.int64) * stride_se + m * stride_sm
        if KIND == 0:
            x = tl.load(row + src).to(tl.float32)
        elif KIND == 1:
            x = tl.load(row + src).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(srow + src // 128)
        else:
            nib = (tl.load(row + src // 2).to(tl.int32) >> (4 * (src % 2))) & 0xF
            ex = (nib >> 1) & 3
            mag = tl.where(ex == 0, 0.5 * (nib & 1), (1.0 + 0.5 * (nib & 1)) * tl.exp2((ex - 1).to(tl.float32)))
            sf = tl.load(srow + src // 16).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            gs = tl.load(GS + e) if GS_PER_EXPERT else tl.load(GS)
            x = tl.where((nib & 8) != 0, -mag, mag) * sf / gs
        y = (x * x_scale).to(tl.float16)
        if PERMUTE:
            y = tl.reshape(tl.permute(tl.reshape(y, [BLOCK // 128, 4, 8, 2, 2]), (0, 2, 3, 1, 4)), [BLOCK])
        tl.store(Y + em.to(tl.int64) * K + mk, y)


def available(device: torch.device) -> str | None:
    """None when the kernel can run on `device`, else why not (asked per MoE call: answered once per device)."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    return wgmma_unavailable(device)


if HAVE_GLUON:
    # the in-loop kernel's DEQ_ASM unpack (value·2^-6 times the block scale). Here elements 0, 1 of a 4-byte pack
    # are row r (scale $5) and elements 2, 3 row r + 8 (scale $7), each scale an (s, s) f16x2
    _DEQ = gl.constexpr(deq_ptx("$5", "$7"))

    # four e4m3 scale bytes → four (s, s) f16x2 (exact)
    _SCALE = gl.constexpr("""
    {
    .reg .b32 t;
    .reg .b16 a, b, c, d;
    prmt.b32 t, $4, 0, 0x1100;
    mov.b32 {a, b}, t;
    cvt.rn.f16x2.e4m3x2 $0, a;
    cvt.rn.f16x2.e4m3x2 $1, b;
    prmt.b32 t, $4, 0, 0x3322;
    mov.b32 {c, d}, t;
    cvt.rn.f16x2.e4m3x2 $2, c;
    cvt.rn.f16x2.e4m3x2 $3, d;
    }
    """)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _listed_block(cnt_ptr, blk, NUM_E, BM: gl.constexpr, E_POW2: gl.constexpr):
        """(expert, first token, row count) of token block blk of the block list in which expert e owns
        ⌈cnt[e] / BM⌉ blocks, experts in order (NUM_E of them, E_POW2 ≥ NUM_E a power of two); past the last
        block the count is 0. Computed from the counts by each program (no schedule kernel before it); the Triton
        kernels' copy is nvfp4_moe.listed_block."""
        EL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ei = gl.arange(0, E_POW2, layout=EL)
        cnt = gl.load(cnt_ptr + ei, mask=ei < NUM_E, other=0)
        nb = (cnt + (BM - 1)) // BM
        ends = gl.associative_scan(nb, 0, _add)  # past NUM_E: the total, never ≤ blk while blk is a block
        found = gl.sum((ends <= blk).to(gl.int32), axis=0)  # experts whose blocks all come before blk
        mine = ei == found
        start = gl.sum(gl.where(mine, ends - nb, 0), axis=0)
        count = gl.sum(gl.where(mine, cnt, 0), axis=0)  # 0 past the last block (found ≥ NUM_E)
        return gl.minimum(found, NUM_E - 1), (blk - start) * BM, count

    @gluon.jit
    def _tile_offsets(PL: gl.constexpr, SL: gl.constexpr):
        """Byte offsets within a tile of thread t's own packed bytes [4, 128, 16] (layout PL) and scales [128, 8]
        (layout SL): what it loads into registers, or copies into the ring and reads back."""
        i16 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, PL)))
        tid = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        b = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, PL)))
        st = gl.arange(0, 128, layout=gl.SliceLayout(1, SL))
        sj = gl.arange(0, 8, layout=gl.SliceLayout(0, SL))
        return (i16[:, None, None] * 2048 + tid[None, :, None] * 16) + b[None, None, :], st[:, None] * 8 + sj[None, :]

    # programmatic dependent launch, in every thread (both are no-ops without it): wait until the previous grid on
    # the stream has completed and its writes are visible; let the next grid start once every program of this one
    # has said so or exited
    _GRID_WAIT = gl.constexpr("griddepcontrol.wait; mov.b32 $0, $1;")
    _LAUNCH_DEPENDENTS = gl.constexpr("griddepcontrol.launch_dependents; mov.b32 $0, $1;")

    @gluon.jit
    def _grid_control(ASM: gl.constexpr):
        """One grid-dependency instruction (`_GRID_WAIT` or `_LAUNCH_DEPENDENTS`) in every thread of the program."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.inline_asm_elementwise(ASM, "=r,r", [gl.full([128], 0, gl.int32, one)], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _load_tile(wp, sp, woff, soff):
        """One tile's packed bytes [4, 128, 16] and scales [128, 8] of this program into registers (`_tile_offsets`:
        thread t's own bytes)."""
        return gl.load(wp + woff), gl.load(sp + soff)

    @gluon.jit
    def _issue_tile(wr, sr, wur, sur, j, KT, w_base, s_base, wu_base, su_base, woff, soff, W_STAGES: gl.constexpr,
                    TWO: gl.constexpr, PL: gl.constexpr, SL: gl.constexpr):
        """cp.async of K tile j's packed bytes and scales (the first tile into wr / sr, with TWO the second into
        wur / sur) into ring slot j % W_STAGES (empty copies past the last tile keep the group count); the caller
        commits the group (`_commit_tile`). Each thread copies exactly the bytes it later reads back (its own
        fragments). Four buffers, not one: Triton's barrier analysis puts a CTA barrier between two copies into the
        same buffer."""
        slot = j % W_STAGES
        wok = gl.full([4, 128, 16], j, gl.int32, PL) < KT
        sok = gl.full([128, 8], j, gl.int32, SL) < KT
        _cp_async(wr.index(slot), w_base + j * 8192 + woff, mask=wok)
        _cp_async(sr.index(slot), s_base + j * 1024 + soff, mask=sok)
        if TWO:
            _cp_async(wur.index(slot), wu_base + j * 8192 + woff, mask=wok)
            _cp_async(sur.index(slot), su_base + j * 1024 + soff, mask=sok)

    @gluon.jit
    def _commit_tile(xr, j, KT, x_rows, x_ok, W_STAGES: gl.constexpr, X_RING: gl.constexpr):
        """With X_RING, cp.async of K tile j's activations [BM, 128] into ring slot j % W_STAGES of xr (none past the
        last tile); then the commit of tile j's group (its weight copies, `_issue_tile`, and these)."""
        if X_RING:
            _cp_async(xr.index(j % W_STAGES), x_rows + j * 128, mask=x_ok & (j < KT))
        async_copy.commit_group()

    @gluon.jit
    def _operand(p, s, LH: gl.constexpr, AL: gl.constexpr):
        """Packed bytes [4, 128, 16] + scales [128, 8] of a tile → the wgmma register A operand [128, 128] fp16
        (value·scale·2^-6): its two 64-row halves (`_operand_half`; i16 = 2·rhi + c2, scale byte 4·rhi + …), the
        same instructions as one unpack of the whole tile (sm90 SASS compared)."""
        p = gl.permute(gl.reshape(p, [2, 2, 128, 16]), (1, 2, 3, 0))
        p0, p1 = gl.split(p)
        s = gl.permute(gl.reshape(s, [128, 2, 4]), (0, 2, 1))
        s0, s1 = gl.split(s)
        a = gl.permute(gl.join(_operand_half(p0, s0, LH, AL), _operand_half(p1, s1, LH, AL)), (2, 0, 1))
        return gl.convert_layout(gl.reshape(a, [128, 128]), AL)

    @gluon.jit
    def _operand_half(p, s, LH: gl.constexpr, AL: gl.constexpr):
        """Rows 64·rhi … 64·rhi + 63 of a tile, from its packed bytes [2, 128, 16] (the tile's i16 = 2·rhi + c2) and
        scales [128, 4] (bytes rsel + 2·c2 of 4·rhi …) → the wgmma register A operand [64, 128] fp16
        (value·scale·2^-6): a relabelling of this thread's registers, then the DEQ_ASM unpack."""
        # bytes [c2, t = (w1 w0 rlo2 rlo1 rlo0 q1 q0), b = (c1 c0 rsel u)] → [row, j] with row = (w1 w0 rsel rlo) and
        # j = (c2 c1 c0 q1 q0 u)
        p = gl.reshape(p, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        p = gl.permute(p, (1, 2, 10, 3, 4, 5, 0, 8, 9, 6, 7, 11))
        wb = gl.convert_layout(gl.reshape(p, [64, 64]), LH, assert_trivial=True)
        s32 = gl.inline_asm_elementwise(_SCALE, "=r,=r,=r,=r,r", [s], dtype=gl.int32, is_pure=True, pack=4)
        # scales [t, (c2 rsel)] → the bytes' order, broadcast over c1, c0, u
        s32 = gl.permute(gl.reshape(s32, [2, 2, 2, 2, 2, 2, 2, 2, 2]), (0, 1, 8, 2, 3, 4, 7, 5, 6))
        s32 = gl.convert_layout(gl.reshape(s32, [2, 2, 2, 2, 2, 2, 2, 1, 1, 2, 2, 1]), p.type.layout,
                                assert_trivial=True)
        s32, _ = gl.broadcast(s32, p.to(gl.int32))
        s32 = gl.convert_layout(gl.reshape(s32, [64, 64]), LH, assert_trivial=True)
        lo, hi = gl.inline_asm_elementwise(_DEQ, "=r,=r,=r,=r,r,r,r,r,r", [wb, s32], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=4)
        w = gl.join(lo, hi)  # [64, 64, 2]
        w = gl.permute(gl.reshape(w, [64, 8, 8, 2]), (0, 1, 3, 2))
        return gl.convert_layout(gl.reshape(w, [64, 128]), AL, assert_trivial=True)

    @gluon.jit
    def _ring_half(wr, sr, slot, h: gl.constexpr, PL: gl.constexpr, SH: gl.constexpr, LH: gl.constexpr,
                   AL: gl.constexpr):
        """Rows 64·h … 64·h + 63 of the tile in ring slot `slot` → the wgmma register A operand [64, 128] fp16
        (MMA_ASYNC): this thread's own bytes of that half, read back from shared memory."""
        p = wr.index(slot).slice(2 * h, 2, dim=0).load(PL)
        s = sr.index(slot).slice(4 * h, 4, dim=1).load(SH)
        return _operand_half(p, s, LH, AL)

    @gluon.jit
    def _join_rows(lo, hi, mma: gl.constexpr):
        """Two [64, BM] accumulators (rows 0 … 63 and 64 … 127 of a tile) → one [128, BM] in layout mma."""
        acc = gl.permute(gl.join(lo, hi), (2, 0, 1))
        return gl.convert_layout(gl.reshape(acc, [2 * lo.shape[0], lo.shape[1]]), mma)

    @gluon.jit
    def _mma_step(p, s, pu, su, x, xs, acc, acc_u, LH: gl.constexpr, AL: gl.constexpr, TWO: gl.constexpr,
                  STORE_X: gl.constexpr = True):
        """One K tile: unpack the first tile (and with TWO the second: gate and up, or two N tiles) into wgmma
        register operands, with STORE_X the activation tile x [BM, 128] into shared memory xs (else xs came through
        the weight ring, X_RING: this thread's copies have landed, the caller's wait_group, and x is not read), the
        MMAs; the fence and the barrier make every thread's tile visible to wgmma. Returns (acc, acc_u)."""
        a = _operand(p, s, LH, AL)
        if STORE_X:
            xs.store(x)
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(a, xs.permute((1, 0)), acc)
        if TWO:
            acc_u = warpgroup_mma(_operand(pu, su, LH, AL), xs.permute((1, 0)), acc_u)
        _cta_barrier()  # xs (or the ring slot) is rewritten by the next step
        return acc, acc_u

    @gluon.jit
    def _mma_step_async(p, s, pu, su, xr, kt, KT, x_rows, x_ok, acc, acc_u, LH: gl.constexpr, AL: gl.constexpr,
                        TWO: gl.constexpr):
        """One K tile with the activation tiles copied into a two-tile shared ring by cp.async, one tile ahead:
        tile kt + 1's copy is issued, tile kt's awaited (issued by the previous step, or before the loop)."""
        nxt = kt + 1
        _cp_async(xr.index(nxt % 2), x_rows + nxt * 128, mask=x_ok & (nxt < KT))
        async_copy.commit_group()
        a = _operand(p, s, LH, AL)
        async_copy.wait_group(1)
        fence_async_shared()
        _cta_barrier()
        xs = xr.index(kt % 2)
        acc = warpgroup_mma(a, xs.permute((1, 0)), acc)
        if TWO:
            acc_u = warpgroup_mma(_operand(pu, su, LH, AL), xs.permute((1, 0)), acc_u)
        _cta_barrier()  # the ring slot read here is refilled by the next step
        return acc, acc_u

    @gluon.jit
    def _frag_gemm(wp, sp, x_ptr, out_ptr, cnt_ptr, s2_ptr, K, N_OUT, M_MAX, up_tiles,
                   stride_xe, stride_xm, stride_oe, stride_om, offs_ptr, NUM_E,
                   BM: gl.constexpr, FUSE_SILU: gl.constexpr, OUT_PERMUTED: gl.constexpr,
                   UNROLL: gl.constexpr = 1, CONTIG: gl.constexpr = False, E_POW2: gl.constexpr = 128,
                   X_ASYNC: gl.constexpr = False, W_STAGES: gl.constexpr = 0, PAIR_N: gl.constexpr = False,
                   PDL: gl.constexpr = False, X_RING: gl.constexpr = False, MMA_ASYNC: gl.constexpr = False,
                   LIST: gl.constexpr = False):
        """out[e, m, n] for the 128 rows n of tile pid_n and the BM tokens m of pid_m (see module docstring).
        LIST: program pid_m is token block pid_m of the block list in which expert e owns ⌈cnt_ptr[e] / BM⌉ blocks
        (`_listed_block`; NUM_E experts, E_POW2 ≥ NUM_E a power of two); programs past the last block exit.
        CONTIG (with LIST): rows of expert e start at row offs_ptr[e] of x and out (stride_xe, stride_oe 0); else
        expert e's rows are x[e] and out[e] (a masked slab). Without LIST, program (pid_e, pid_m) of the grid's
        axes 1 and 2 is expert pid_e's token block pid_m.
        W_STAGES ≥ 2: the weight tiles go through a W_STAGES-slot shared ring filled by cp.async W_STAGES - 1 tiles
        ahead (UNROLL and X_ASYNC unused), with X_RING the activation tiles too (in the same commit groups, read by
        wgmma where they land); 0: loaded into registers at the top of each step.
        PAIR_N (not with FUSE_SILU): program pid_n computes the two N tiles 2·pid_n and 2·pid_n + 1 from one pass over
        the activations (half the activation reads and programs).
        PDL (launched with programmatic dependent launch): the program lets the next grid start at once, reads only
        the counts (complete before the previous grid started) and, with a ring, issues its first tile's weight
        copies before it waits for the previous grid (which wrote x); it writes nothing before. Every program waits,
        those without rows too, so that this grid's completion implies the previous grid's."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        # a half tile's packed bytes as [row, j] (`_operand_half`)
        LH: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]],
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 64])
        PL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [1, 4, 1], [2, 1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.float16)

        TWO: gl.constexpr = FUSE_SILU or PAIR_N  # two weight tiles per K step, one activation tile
        if PDL:
            _grid_control(_LAUNCH_DEPENDENTS)
        pid_n = gl.program_id(0)
        if LIST:
            e, m0, count = _listed_block(cnt_ptr, gl.program_id(1), NUM_E, BM, E_POW2)
            if CONTIG:
                row0 = gl.load(offs_ptr + e)
            else:
                row0 = 0
        else:
            e = gl.program_id(1)
            m0 = gl.program_id(2) * BM
            count = gl.load(cnt_ptr + e)
            row0 = 0
        if m0 < count:
            KT = K // 128
            e64 = e.to(gl.int64)
            tiles = (N_OUT // 128) + up_tiles  # tiles per expert in the packed tensors
            if PAIR_N:
                t0 = 2 * pid_n
                t1 = t0 + 1
            else:
                t0 = pid_n
                t1 = pid_n + up_tiles
            w_base = wp + (e64 * tiles + t0) * KT * 8192
            s_base = sp + (e64 * tiles + t0) * KT * 1024
            wu_base = wp + (e64 * tiles + t1) * KT * 8192
            su_base = sp + (e64 * tiles + t1) * KT * 1024
            xm = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
            xk = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
            x_rows = (x_ptr + e64 * stride_xe + gl.expand_dims((row0 + m0 + xm).to(gl.int64) * stride_xm, 1)
                      + gl.expand_dims(xk, 0))
            x_ok = gl.expand_dims(m0 + xm < count, 1)
            if X_ASYNC:  # activation tiles through a two-tile ring filled by cp.async one tile ahead
                if PDL:
                    _grid_control(_GRID_WAIT)
                x_ok = x_ok & gl.expand_dims(xk < 128, 0)
                xr = gl.allocate_shared_memory(gl.float16, [2, BM, 128], XS)
                _cp_async(xr.index(0), x_rows, mask=x_ok)
                async_copy.commit_group()
            elif X_RING:  # activation tiles in the weight ring's slots
                x_ok = x_ok & gl.expand_dims(xk < 128, 0)
                xr = gl.allocate_shared_memory(gl.float16, [W_STAGES, BM, 128], XS)
                xs = xr.index(0)  # (not used)
            else:
                xs = gl.allocate_shared_memory(gl.float16, [BM, 128], XS)
                xr = xs  # (not used)
            acc = gl.zeros([128, BM], gl.float32, layout=mma)
            acc_u = gl.zeros([128, BM], gl.float32, layout=mma)
            woff, soff = _tile_offsets(PL, SL)
            if W_STAGES > 0:
                WSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
                SSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
                wr = gl.allocate_shared_memory(gl.uint8, [W_STAGES, 4, 128, 16], WSL)
                sr = gl.allocate_shared_memory(gl.uint8, [W_STAGES, 128, 8], SSL)
                if TWO:
                    wur = gl.allocate_shared_memory(gl.uint8, [W_STAGES, 4, 128, 16], WSL)
                    sur = gl.allocate_shared_memory(gl.uint8, [W_STAGES, 128, 8], SSL)
                else:  # (not written)
                    wur, sur = wr, sr
                for j in gl.static_range(W_STAGES - 1):
                    _issue_tile(wr, sr, wur, sur, j, KT, w_base, s_base, wu_base, su_base, woff, soff, W_STAGES,
                                TWO, PL, SL)
                    if PDL and j == 0:
                        _grid_control(_GRID_WAIT)  # (after the first weight copies, before any activation read)
                    _commit_tile(xr, j, KT, x_rows, x_ok, W_STAGES, X_RING)
                if MMA_ASYNC:
                    # (X_RING) each tile as two 64-row halves, each with its own accumulator: a half's operand is
                    # built while the previous half's MMA runs, the next tile's first half during the last MMA
                    SH: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])
                    g0 = gl.zeros([64, BM], gl.float32, layout=mma)
                    g1 = gl.zeros([64, BM], gl.float32, layout=mma)
                    u0 = gl.zeros([64, BM], gl.float32, layout=mma)
                    u1 = gl.zeros([64, BM], gl.float32, layout=mma)
                    async_copy.wait_group(W_STAGES - 2)  # tile 0's copies (this thread's) have landed
                    a = _ring_half(wr, sr, 0, 0, PL, SH, LH, AL)
                    fence_async_shared()
                    _cta_barrier()
                    _issue_tile(wr, sr, wur, sur, W_STAGES - 1, KT, w_base, s_base, wu_base, su_base, woff, soff,
                                W_STAGES, TWO, PL, SL)
                    _commit_tile(xr, W_STAGES - 1, KT, x_rows, x_ok, W_STAGES, X_RING)
                    for kt in range(KT):
                        slot = kt % W_STAGES
                        xt = xr.index(slot).permute((1, 0))
                        t = warpgroup_mma(a, xt, g0, is_async=True)
                        b = _ring_half(wr, sr, slot, 1, PL, SH, LH, AL)
                        tb = warpgroup_mma(b, xt, g1, is_async=True)
                        g0, a = warpgroup_mma_wait(1, deps=(t, a))
                        if TWO:
                            a = _ring_half(wur, sur, slot, 0, PL, SH, LH, AL)
                            t = warpgroup_mma(a, xt, u0, is_async=True)
                            g1, b = warpgroup_mma_wait(1, deps=(tb, b))
                            b = _ring_half(wur, sur, slot, 1, PL, SH, LH, AL)
                            tb = warpgroup_mma(b, xt, u1, is_async=True)
                            u0, a = warpgroup_mma_wait(1, deps=(t, a))
                        async_copy.wait_group(W_STAGES - 2)  # tile kt + 1's (none past the last tile)
                        a = _ring_half(wr, sr, (kt + 1) % W_STAGES, 0, PL, SH, LH, AL)
                        # (ptxas places most of this unpack after the wait below all the same)
                        if TWO:
                            u1, b = warpgroup_mma_wait(0, deps=(tb, b))
                        else:
                            g1, b = warpgroup_mma_wait(0, deps=(tb, b))
                        fence_async_shared()
                        _cta_barrier()  # tile kt + 1's activations visible to wgmma; every MMA of slot kt done
                        _issue_tile(wr, sr, wur, sur, kt + W_STAGES, KT, w_base, s_base, wu_base, su_base, woff,
                                    soff, W_STAGES, TWO, PL, SL)
                        _commit_tile(xr, kt + W_STAGES, KT, x_rows, x_ok, W_STAGES, X_RING)
                    acc = _join_rows(g0, g1, mma)
                    if TWO:
                        acc_u = _join_rows(u0, u1, mma)
                else:
                    for kt in range(KT):
                        _issue_tile(wr, sr, wur, sur, kt + (W_STAGES - 1), KT, w_base, s_base, wu_base, su_base,
                                    woff, soff, W_STAGES, TWO, PL, SL)
                        _commit_tile(xr, kt + (W_STAGES - 1), KT, x_rows, x_ok, W_STAGES, X_RING)
                        if not X_RING:
                            x = gl.load(x_rows + kt * 128, mask=x_ok, other=0.0)
                        async_copy.wait_group(W_STAGES - 1)  # tile kt's copies (this thread's) have landed
                        slot = kt % W_STAGES
                        p = wr.index(slot).load(PL)
                        s = sr.index(slot).load(SL)
                        if TWO:
                            pu = wur.index(slot).load(PL)
                            su = sur.index(slot).load(SL)
                        else:  # (not read by the step)
                            pu, su = p, s
                        if X_RING:
                            acc, acc_u = _mma_step(p, s, pu, su, acc, xr.index(slot), acc, acc_u, LH, AL, TWO,
                                                   STORE_X=False)
                        else:
                            acc, acc_u = _mma_step(p, s, pu, su, x, xs, acc, acc_u, LH, AL, TWO)
                async_copy.wait_group(0)  # no copy may land after the program has left its shared memory
            else:
                if PDL and not X_ASYNC:
                    _grid_control(_GRID_WAIT)
                for kt0 in range(0, KT, UNROLL):
                    # UNROLL tiles' bytes requested together (more bytes in flight), then computed one by one
                    p, s = _load_tile(w_base + kt0 * 8192, s_base + kt0 * 1024, woff, soff)
                    if TWO:
                        pu, su = _load_tile(wu_base + kt0 * 8192, su_base + kt0 * 1024, woff, soff)
                    else:  # (not read by the step)
                        pu, su = p, s
                    if not X_ASYNC:
                        x = gl.load(x_rows + kt0 * 128, mask=x_ok, other=0.0)
                    if UNROLL == 2:
                        p2, s2 = _load_tile(w_base + (kt0 + 1) * 8192, s_base + (kt0 + 1) * 1024, woff, soff)
                        if TWO:
                            pu2, su2 = _load_tile(wu_base + (kt0 + 1) * 8192, su_base + (kt0 + 1) * 1024, woff, soff)
                        else:
                            pu2, su2 = p2, s2
                        if not X_ASYNC:
                            x2 = gl.load(x_rows + (kt0 + 1) * 128, mask=x_ok, other=0.0)
                    if X_ASYNC:
                        acc, acc_u = _mma_step_async(p, s, pu, su, xr, kt0, KT, x_rows, x_ok, acc, acc_u, LH, AL,
                                                     TWO)
                        if UNROLL == 2:
                            acc, acc_u = _mma_step_async(p2, s2, pu2, su2, xr, kt0 + 1, KT, x_rows, x_ok, acc, acc_u,
                                                         LH, AL, TWO)
                    else:
                        acc, acc_u = _mma_step(p, s, pu, su, x, xs, acc, acc_u, LH, AL, TWO)
                        if UNROLL == 2:
                            acc, acc_u = _mma_step(p2, s2, pu2, su2, x2, xs, acc, acc_u, LH, AL, TWO)
            alpha = gl.load(s2_ptr + e) * 16384.0  # weight_scale_2 · ALPHA (2^6 · 2^8, exact)
            res = acc * alpha
            if FUSE_SILU:
                res = res / (1.0 + gl.exp(-res)) * (acc_u * alpha) * 0.00390625  # the next GEMM's 2^-8
            on = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
            om = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
            if OUT_PERMUTED:  # the down GEMM's MMA K order: model column k' of a tile is MMA column πinv(k')
                kk = on % 128
                col = (on // 128) * 128 + 16 * ((kk // 4) % 8) + 8 * ((kk // 2) % 2) + 2 * (kk // 32) + kk % 2
            else:
                col = on
            if PAIR_N:
                col = col + pid_n * 128  # tile 2·pid_n; the second tile's rows follow
            o = (out_ptr + e64 * stride_oe + gl.expand_dims((row0 + om).to(gl.int64) * stride_om, 0)
                 + gl.expand_dims(col, 1))
            gl.store(o, res.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(om < count, 0))
            if PAIR_N:
                gl.store(o + 128, (acc_u * alpha).to(out_ptr.dtype.element_ty), mask=gl.expand_dims(om < count, 0))
        else:
            if PDL:
                _grid_control(_GRID_WAIT)


ALPHA = 64.0 * 256.0  # the unpack's value·2^-6 and the activations' ·2^-8, undone in the epilogue
X_SCALE = 2.0 ** -8  # the activations' scale, passed to `_prep_x` at run time (see there)


def frag_gemm(x: torch.Tensor, wp: torch.Tensor, sp: torch.Tensor, scale_2: torch.Tensor, out: torch.Tensor,
              counts: torch.Tensor, *, n_out: int, fuse_silu: bool, block_m: int = 16, unroll: int = 1,
              offsets: torch.Tensor | None = None, listed: bool = False,
              x_async: bool = False, w_stages: int = 0, maxnreg: int | None = None,
              pair_n: bool = False, pdl: bool = False, x_ring: bool = False,
              mma_async: bool = False, blocks: int | None = None) -> torch.Tensor:
    """out = act(x · W[e]ᵀ) for each expert e's rows (the others are not written).

    Masked (offsets None): x [E, M, K], out [E, M, n_out]; rows m < counts[e] of expert e.
    Contiguous (offsets [E + 1] int32): x [N, K], out [N, n_out]; expert e's rows are offsets[e] …
    offsets[e] + counts[e] - 1, run as a block list: expert e owns ⌈counts[e] / block_m⌉ token blocks, experts in
    order (`block_schedule`; each program finds its block from the counts). The grid launches `blocks` token
    blocks per N tile (None: `max_blocks(N, E, block_m)` for contiguous rows, E·⌈M / block_m⌉ for a slab), programs
    past the last block exit. A slab runs the same block list with `listed` (the blocks of experts with rows first, so
    that they spread over the SMs as one wave; `slab_blocks` of them), else one program per (expert, token block).
    x: fp16, ·2^-8, columns in MMA K order: `prepare_activations`' output for the gate_up GEMM, the gate_up output
    for the down GEMM (written so when fuse_silu).
    wp, sp: `pack_weights` / `pack_scales` of W [E, N, K/2] (gate_up: N = 2·n_out, gate rows then up rows).
    scale_2: [E] fp32, weight_scale_2 (the kernel multiplies it by ALPHA). out: fp16 when fuse_silu (it feeds the down
    GEMM), else the caller's dtype. counts: [E] int32. block_m: tokens per program (16, 32 or 64; the wgmma N).
    unroll: K tiles whose loads are issued together (1 or 2; 1 when K/128 is odd). x_async: the activation tiles go
    to shared memory by cp.async one tile ahead (instead of through registers). w_stages (0, or ≥ 2): the weight
    tiles through a shared ring of that many slots filled by cp.async w_stages - 1 tiles ahead, instead of loaded into
    registers at each step (unroll and x_async then unused); x_ring: with a ring, the activation tiles go through it
    too (cp.async, in the weights' groups) instead of registers. maxnreg: the register cap per thread given to ptxas
    (128 fits four programs per SM). pair_n: each program computes two adjacent 128-row N tiles from one pass over
    its activations (not with fuse_silu; n_out a multiple of 256). pdl: launched with programmatic dependent launch
    (sm90+): the programs start while the previous kernel on the stream (`prepare_activations(pdl=True)` or the gate_up
    GEMM) finishes, and issue their first weight copies before they wait for it; that kernel must write nothing
    this one reads except x. mma_async (with a ring and x_ring): each tile's two 64-row halves go to wgmma
    asynchronously, each half's operand unpacked while the previous half's MMA runs (the next tile's first half
    during the tile's last MMA), instead of one synchronous MMA per tile after its whole unpack. Graph-safe (no host
    sync)."""
    if mma_async and not (w_stages and x_ring):
        raise ValueError("frag_gemm: mma_async needs a weight ring (w_stages ≥ 2) with x_ring")
    if pair_n and (fuse_silu or n_out % (2 * TILE)):
        raise ValueError(f"frag_gemm: pair_n needs fuse_silu False and n_out % 256 == 0 (n_out={n_out})")
    if w_stages == 1 or w_stages < 0:
        raise ValueError(f"frag_gemm: w_stages={w_stages}; use 0 (weights through registers) or a ring of ≥ 2 slots")
    K = x.shape[-1]
    if fuse_silu and out.dtype != torch.float16:
        raise ValueError("frag_gemm: the gate_up output feeds the down GEMM and must be fp16 (MMA K order, ·2^-8)")
    up_tiles = n_out // TILE if fuse_silu else 0
    E = counts.numel()
    n_tiles = n_out // (2 * TILE if pair_n else TILE)
    contig = offsets is not None
    if not contig:
        M = x.shape[1]
        strides = (x.stride(0), x.stride(1), out.stride(0), out.stride(1))
        offsets = counts  # (not read)
        if listed:
            grid = (n_tiles, slab_blocks(E, M, block_m, blocks))
        else:
            grid = (n_tiles, E, -(-M // block_m))
    else:
        M = x.shape[0]
        grid = (n_tiles, max_blocks(M, E, block_m) if blocks is None else blocks)
        strides = (0, x.stride(0), 0, out.stride(0))
    if grid[1] == 0 or (len(grid) == 3 and grid[2] == 0) or E == 0:
        return out
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    _frag_gemm[grid](wp, sp, x, out, counts, scale_2, K, n_out, M, up_tiles, *strides, offsets, E,
                     BM=block_m, FUSE_SILU=fuse_silu, OUT_PERMUTED=fuse_silu,
                     UNROLL=unroll if (K // TILE) % unroll == 0 else 1, CONTIG=contig, LIST=contig or listed,
                     E_POW2=_e_pow2(E), X_ASYNC=x_async and not w_stages,
                     W_STAGES=w_stages, PAIR_N=pair_n, PDL=pdl, X_RING=x_ring and w_stages > 0, MMA_ASYNC=mma_async,
                     num_warps=4,
                     launch_pdl=pdl, **extra)
    return out


def _e_pow2(experts: int) -> int:
    """The block search's width: a power of two ≥ experts, at least 128 (one lane per expert over four warps)."""
    return max(128, triton.next_power_of_2(experts))


def block_schedule(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """[E + 1] int32: the first token block of each expert in a block list (expert e owns ⌈counts[e] / block_m⌉
    blocks), then the total. counts: [E] int32. The kernels compute the same from the counts in each program; this
    is its reference (tests, tools). Graph-safe."""
    blocks = (counts.to(torch.int32) + (block_m - 1)) // block_m
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=counts.device),
                      torch.cumsum(blocks, 0, dtype=torch.int32)])


def run_frag(layout, packs: dict, intermediate: int, out_dtype: torch.dtype, block_m: int,
             unroll_down: int = 2, x_async_down: bool = False, ring: int = 0, ring_down: int = 0,
             maxnreg: int | None = None, pair_down: bool = False, pdl: bool = False,
             x_ring: bool = False, mma_async: bool = False, slab_list: bool | None = None) -> torch.Tensor:
    """The experts on a Masked slab or Contiguous rows (bf16 / fp8 / nvfp4 payload) → [E, M, H] or [N, H]
    `out_dtype` (rows past an expert's count unwritten). packs: {"w13", "w13_sf", "w13_s2", "w2", "w2_sf", "w2_s2"}
    (`pack_experts`, or the tensors of experts stored in fragment order). block_m: tokens per program (16, 32, 64);
    unroll_down: the down GEMM's K tiles loaded together (1, 2); x_async_down: the down GEMM's activation tiles by
    cp.async (`frag_gemm`'s x_async; gate_up is slower with it at every measured token count); ring / ring_down:
    the gate_up / down GEMM's weight ring slots (`frag_gemm`'s w_stages; 0: registers); maxnreg: both GEMMs' register
    cap per thread (None: ptxas's choice); pair_down: the down GEMM's programs take two N tiles each
    (`frag_gemm`'s pair_n); pdl: the two GEMMs launched with programmatic dependent launch, each starting (and
    copying its first weight tiles) while the kernel before it finishes (`frag_gemm`'s pdl); x_ring: each GEMM with
    a ring takes its activation tiles through it (`frag_gemm`'s x_ring); mma_async: each GEMM with a ring and x_ring
    issues its MMAs asynchronously, half a tile at a time (`frag_gemm`'s mma_async); slab_list: a Masked slab runs
    as a block list of its experts' token blocks (the blocks with rows first, at most `max_blocks(layout.max_rows)`
    when the layout bounds its rows) instead of one program per slab block (False); None: the list where the layout
    bounds its rows (`Masked.max_rows`), else one program per slab block. Contiguous rows always run the block list.

    On an H200 (DeepSeek-R1 experts, bf16 activations, CUDA graphs), one token on 8 of 256 experts: 154 → 85 µs in
    a one-row slab, 473 → 85 µs in a 256-row slab; 4 tokens on 31: 570 → 232 µs, 16 on 98: 986 → 662 µs in the
    256-row slab (bench/results/NVIDIA_H200/moe_experts/2026-12-02_slab_list). Without a bound the list launches as
    many programs as the slab has blocks, each scanning the counts: 4–12 % slower than the plain grid in the 256-row
    slab from 4 tokens on, hence the automatic choice."""
    masked = layout.hidden.dim() == 3
    counts = (layout.masked_m if masked else layout.counts).to(torch.int32)
    offsets = None if masked else layout.offsets.to(torch.int32)
    max_rows = getattr(layout, "max_rows", None)
    if slab_list is None:
        slab_list = max_rows is not None
    blocks = None
    if masked and slab_list and max_rows is not None:
        blocks = max_blocks(max_rows, counts.numel(), block_m)
    x = prepare_activations(layout.hidden, counts, layout.payload, layout.scales, layout.global_scale, offsets,
                            pdl=pdl, block_m=block_m if (masked and slab_list) else 0, blocks=blocks)
    lead, H = x.shape[:-1], x.shape[-1]
    h = torch.empty(lead + (intermediate,), dtype=torch.float16, device=x.device)
    frag_gemm(x, packs["w13"], packs["w13_sf"], packs["w13_s2"], h, counts, n_out=intermediate, fuse_silu=True,
              block_m=block_m, offsets=offsets, listed=slab_list, w_stages=ring, maxnreg=maxnreg, pdl=pdl,
              x_ring=x_ring, mma_async=mma_async and ring > 0 and x_ring, blocks=blocks)
    out = torch.empty(lead + (H,), dtype=out_dtype, device=x.device)
    # without a ring, two K tiles' bytes requested together: 167 → 160 µs at 1 token/expert, 187 → 172 µs at 16
    # (EP4, H200; bit-equal)
    return frag_gemm(h, packs["w2"], packs["w2_sf"], packs["w2_s2"], out, counts, n_out=H, fuse_silu=False,
                     block_m=block_m, unroll=unroll_down, offsets=offsets, listed=slab_list,
                     x_async=x_async_down, w_stages=ring_down, maxnreg=maxnreg, pair_n=pair_down, pdl=pdl,
                     x_ring=x_ring, mma_async=mma_async and ring_down > 0 and x_ring, blocks=blocks)


def prepare_activations(x: torch.Tensor, counts: torch.Tensor, payload: str = "bf16",
                        scales: torch.Tensor | None = None, global_scale: torch.Tensor | None = None,
                        offsets: torch.Tensor | None = None, permute_in_registers: bool = True,
                        block: int | None = None, pdl: bool = False, block_m: int = 0,
                        blocks: int | None = None) -> torch.Tensor:
    """Activations → fp16 ·2^-8 with columns in MMA K order. Masked slab (offsets None): x [E, M, ·] → [E, M, K],
    rows m < counts[e] (others unwritten). Contiguous rows (offsets [E + 1] int32): x [N, ·] → [N, K], every row.
    x: float ("bf16"); float8_e4m3fn + scales fp32 [.., K/128] ("fp8"); uint8 [.., K/2] + scales e4m3 [.., K/16]
    + global_scale [1] or [E] ("nvfp4"). permute_in_registers: read the rows contiguously and reorder in registers
    (`_prep_x`'s PERMUTE; False: gather each column from memory). block: columns per program (a multiple of 128
    dividing K; None: the largest of 1024, 512, 128 that does). pdl: the next kernel, launched with programmatic
    dependent launch (`frag_gemm(pdl=True)`), may start at once. block_m > 0, blocks (a masked slab only): one
    program per row of the first `blocks` (None: all) token blocks of the slab's block list (`frag_gemm(listed=True)`,
    blocks of block_m rows) instead of one per slab row. Graph-safe."""
    kind = {"bf16": 0, "fp8": 1, "nvfp4": 2}[payload]
    rows = offsets is not None
    if rows:  # each row its own (E = N, M = 1) slab, all rows converted
        x = x.unsqueeze(1)
        scales = None if scales is None else scales.unsqueeze(1)
        if kind == 2 and global_scale.numel() > 1:  # one global scale per expert → one per row
            n = x.shape[0]
            owner = torch.searchsorted(offsets[1:].to(torch.int64), torch.arange(n, device=x.device), right=True)
            global_scale = global_scale.float().reshape(-1)[owner.clamp_(max=global_scale.numel() - 1)]
    E, M, C = x.shape
    K = 2 * C if kind == 2 else C
    if x.stride(-1) != 1:
        x = x.contiguous()
    if kind:
        x = x.view(torch.uint8)
        scales = scales.view(torch.uint8) if kind == 2 else scales.float()
        scales = scales if scales.stride(-1) == 1 else scales.contiguous()
        gs = global_scale.float().reshape(-1).contiguous() if kind == 2 else scales
    else:
        scales = gs = x
    y = torch.empty(E, M, K, dtype=torch.float16, device=x.device)
    if E * M:
        block = block or next((b for b in (1024, 512) if K % b == 0), 128)
        if block % 128 or K % block:
            raise ValueError(f"prepare_activations: block={block} must be a multiple of 128 dividing K={K}")
        if block_m and not rows:
            progs = block_m * slab_blocks(E, M, block_m, blocks)
            extra = dict(NUM_E=E, BM=block_m, E_POW2=_e_pow2(E))
        else:
            progs, extra = E * M, {}
        if progs:
            _prep_x[(progs, K // block)](x, scales, gs, y, counts, M, K, x.stride(0), x.stride(1),
                                         scales.stride(0) if kind else 0, scales.stride(1) if kind else 0, X_SCALE,
                                         KIND=kind,
                                         GS_PER_EXPERT=kind == 2 and gs.numel() > 1, BLOCK=block, ALL_ROWS=rows,
                                         PERMUTE=permute_in_registers, PDL=pdl, num_warps=4, **extra)
    return y.squeeze(1) if rows else y


def pack_experts(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, w13_s2: torch.Tensor,
                 w2_s2: torch.Tensor) -> dict:
    """The experts' NVFP4 tensors (modelopt layout) in fragment order: w13 [E, 2I, H/2] uint8, s13 [E, 2I, H/16]
    e4m3, w2 [E, H, I/2] uint8, s2 [E, H, I/16] e4m3 → {"w13", "w13_sf", "w2", "w2_sf"} (`pack_weights` /
    `pack_scales`, the triton runner's key names for every layout), with the weight_scale_2 vectors w13_s2, w2_s2
    [E] fp32 ("w13_s2", "w2_s2") that the epilogue multiplies by ALPHA."""
    return {"w13": pack_weights(w13), "w13_sf": pack_scales(s13), "w13_s2": w13_s2.float().contiguous(),
            "w2": pack_weights(w2), "w2_sf": pack_scales(s2), "w2_s2": w2_s2.float().contiguous()}
