"""Probe the fp8 Gluon kernel's shared layouts and q·k MMA on a GPU (debug)."""
import json, sys, torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from pdlab.attention import gluon_mla as G
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

B3 = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, 4, 1], [2, 1, 0]))
B2 = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))

@gluon.jit
def probe_view(SRC, DST, VIEW_OK: gl.constexpr):
    # copy [64, 512] bytes via CPL into the NVMMA [4, 64, 128] buffer through the view; read back by NVMMA addressing
    buf = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 128], G._BLK)
    tau = gl.arange(0, 64, layout=gl.SliceLayout(1, G._CPL))
    col = gl.arange(0, 512, layout=gl.SliceLayout(0, G._CPL))
    ptr = SRC + gl.expand_dims(tau, 1) * 512 + gl.expand_dims(col, 0)
    G._cp_async(G._bytes(buf, 0), ptr)
    async_copy.commit_group()
    async_copy.wait_group(0)
    G._cta_barrier()
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, B2))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, B2))
    for b in gl.static_range(4):
        v = buf.index(b)._reinterpret(gl.uint8, [64, 128], G._BLK).load(B2)
        gl.store(DST + gl.expand_dims(r, 1) * 512 + b * 128 + gl.expand_dims(c, 0), v)

@gluon.jit
def probe_pe(SRC, DST):
    buf = gl.allocate_shared_memory(gl.float8e4nv, [64, 64], G._PE_BLK)
    tau = gl.arange(0, 64, layout=gl.SliceLayout(1, G._PCL))
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, G._PCL))
    G._cp_async(buf._reinterpret(gl.uint8, [64, 64], G._PE_BLK), SRC + gl.expand_dims(tau, 1) * 64 + gl.expand_dims(col, 0))
    async_copy.commit_group()
    async_copy.wait_group(0)
    G._cta_barrier()
    L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    v = buf._reinterpret(gl.uint8, [64, 64], G._PE_BLK).load(L)
    gl.store(DST + gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0), v)

@gluon.jit
def probe_qk(K, Q, S, QPARTS: gl.constexpr, HM: gl.constexpr, VIA_VIEW: gl.constexpr):
    # K [64, 128] e4m3 bytes, Q [HM, 128] fp32 → S [64, HM] = K · q^T via the q parts and one fp8 wgmma
    NQ: gl.constexpr = QPARTS * HM
    SMMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 32])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16])
    kb = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 128], G._BLK)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, B2))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, B2))
    k = gl.load(K + gl.expand_dims(r, 1) * 128 + gl.expand_dims(c, 0))
    kb.index(0)._reinterpret(gl.uint8, [64, 128], G._BLK).store(k)
    qr = gl.arange(0, HM, layout=gl.SliceLayout(1, B2))
    q = gl.load(Q + gl.expand_dims(qr, 1) * 128 + gl.expand_dims(c, 0))
    qs = gl.allocate_shared_memory(gl.float8e4nv, [NQ, 128], G._BLK)
    qs.store(G._q_parts(q, QPARTS))
    fence_async_shared()
    G._cta_barrier()
    s = warpgroup_mma(kb.index(0), qs.permute((1, 0)), gl.zeros([64, NQ], gl.float32, layout=SMMA), use_acc=False)
    s = gl.convert_layout(G._sum_parts(s, QPARTS, HM), MMA, assert_trivial=True)
    sr = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    sc = gl.arange(0, HM, layout=gl.SliceLayout(0, MMA))
    gl.store(S + gl.expand_dims(sr, 1) * HM + gl.expand_dims(sc, 0), s)

@gluon.jit
def probe_parts(Q, P, QPARTS: gl.constexpr, HM: gl.constexpr):
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, B2))
    qr = gl.arange(0, HM, layout=gl.SliceLayout(1, B2))
    q = gl.load(Q + gl.expand_dims(qr, 1) * 128 + gl.expand_dims(c, 0))
    p = G._q_parts(q, QPARTS)
    pr = gl.arange(0, QPARTS * HM, layout=gl.SliceLayout(1, B2))
    p = gl.convert_layout(p, B2)
    gl.store(P + gl.expand_dims(pr, 1) * 128 + gl.expand_dims(c, 0), p.to(gl.uint8, bitcast=True))

def main():
    torch.manual_seed(0)
    dev = "cuda"
    out = {}
    src = torch.randint(0, 256, (64, 512), dtype=torch.uint8, device=dev)
    dst = torch.zeros(4 * 64 * 128, dtype=torch.uint8, device=dev)
    try:
        probe_view[(1,)](src, dst, True, num_warps=4)
        got = dst.view(64, 512)
        out["view_equal"] = bool(torch.equal(got, src))
        out["view_mismatch_frac"] = float((got != src).float().mean())
        tok = torch.arange(64, device=dev, dtype=torch.uint8)[:, None].expand(64, 512).contiguous()
        piece = (torch.arange(512, device=dev) // 16).to(torch.uint8)[None, :].expand(64, 512).contiguous()
        maps = {}
        for name, pat in (("tok", tok), ("piece", piece)):
            d = torch.zeros_like(dst)
            probe_view[(1,)](pat, d, True, num_warps=4)
            maps[name] = d.view(64, 512)
        # for NVMMA coordinate (row, 16-byte piece): the (token, piece) that landed there
        out["view_map_rows0_9"] = [[(int(maps["tok"][r, 16 * p]), int(maps["piece"][r, 16 * p])) for p in range(0, 32, 4)] for r in range(10)]
        srcp = torch.randint(0, 256, (64, 64), dtype=torch.uint8, device=dev)
        dstp = torch.zeros_like(srcp)
        probe_pe[(1,)](srcp, dstp, num_warps=4)
        out["pe_equal"] = bool(torch.equal(srcp, dstp))
    except Exception as e:
        out["view_error"] = repr(e)[:800]
    for qp in (2, 4):
        try:
            q = (torch.randn(16, 128, device=dev) * 40).to(torch.bfloat16 if qp == 2 else torch.float16).float()
            q = q / q.abs().amax(1, keepdim=True) * 200
            q = q.to(torch.bfloat16 if qp == 2 else torch.float16).float()
            p = torch.zeros(qp * 16, 128, dtype=torch.uint8, device=dev)
            probe_parts[(1,)](q, p, qp, 16, num_warps=4)
            parts = p.view(torch.float8_e4m3fn).float().view(qp, 16, 128)
            out[f"parts{qp}_maxerr"] = float((parts.sum(0) - q).abs().max())
            out[f"parts{qp}_nan"] = int(torch.isnan(parts).sum())
            out[f"parts{qp}_sample"] = [float(q[0, 0]), [float(x) for x in parts[:, 0, 0]], float(q[1, 5]), [float(x) for x in parts[:, 1, 5]]]
            out[f"parts{qp}_p0err"] = float((parts[0] - q.to(torch.float8_e4m3fn).float()).abs().max())
            out[f"parts{qp}_bytes"] = p.view(qp, 16, 128)[:, 0, :4].tolist()
            kb = torch.randint(0, 256, (64, 128), dtype=torch.uint8, device=dev)
            kf = kb.view(torch.float8_e4m3fn).float()
            kf = torch.where(torch.isnan(kf), 0, kf); kb = kf.to(torch.float8_e4m3fn).view(torch.uint8)
            s = torch.zeros(64, 16, device=dev)
            probe_qk[(1,)](kb, q, s, qp, 16, False, num_warps=4)
            ref = kf @ q.t()
            out[f"qk{qp}_relerr"] = float((s - ref).norm() / ref.norm())
            out[f"qk{qp}_ref_vs_parts"] = float((kf @ parts.sum(0).t() - ref).norm() / ref.norm())
            # which row/col permutation? correlation of s against ref rows
            out[f"qk{qp}_s00"] = [float(s[0, 0]), float(ref[0, 0]), float(s[1, 0]), float(ref[1, 0]), float(s[0, 1]), float(ref[0, 1])]
        except Exception as e:
            out[f"qk{qp}_error"] = repr(e)[:800]
    out.pop("view_map_rows0_9", None)
    print(json.dumps(out))

main()
