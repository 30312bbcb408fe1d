"""The 64-row Gluon MLA decode kernel (attention/gluon_mla_wide.py, bf16/fp16 and fp8 pools): its selection rule, split
rule, descriptor cache and refusals on CPU, its sm90 compilation on any machine, and on a GPU its results against the
fp32 reference (FlashMLA's bar: cosine error < 1e-5 on out and lse; over fp8 pools against the reference on the same
bytes, as for the other fp8 kernels) with NaN in every row past each sequence's length."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from pdlab.attention import gluon_mla_wide as W
from pdlab.attention import mla_decode
from pdlab.attention import triton_kernels as tk
from pdlab.attention.backends.reference import _rows
from pdlab.attention.workloads import decode_problem
from pdlab.bench.harness import cosine_error
from pdlab.kernels.arch import SM90


def test_unfit_names_what_the_kernel_does_not_take():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert W.unfit(128, 1, bf16, bf16, 64) is None and W.unfit(64, 1, fp16, fp16, 128) is None
    assert W.unfit(32, 2, bf16, bf16, 64) is None and W.unfit(16, 4, bf16, bf16, 64) is None
    assert W.unfit(128, 1, torch.uint8, bf16, 64) is None and W.unfit(128, 2, torch.uint8, fp16, 128) is None
    assert "reads bf16, fp16 or fp8" in W.unfit(128, 1, torch.float32, torch.float32, 64)
    assert "computes in 16 bits" in W.unfit(128, 1, torch.uint8, torch.float32, 64)
    assert "queries over a" in W.unfit(128, 1, bf16, fp16, 64)
    assert "do not split into programs of 64 rows" in W.unfit(48, 1, bf16, bf16, 64)
    assert "do not split" in W.unfit(16, 1, bf16, bf16, 64)
    assert "S_q 3" in W.unfit(128, 3, bf16, bf16, 64)
    assert "S_q 0" in W.unfit(128, 0, bf16, bf16, 64)  # prefill (ragged queries) is not this kernel's
    assert "page size 32" in W.unfit(128, 1, bf16, bf16, 32)


def _q(heads=128, dtype=torch.bfloat16):
    return torch.zeros(2, heads, 576, dtype=dtype)


def test_selection_picks_the_kernel_that_fits_and_explains_when_none_does():
    kv16 = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    # no GPU here: "auto" runs neither Gluon kernel; "gluon" says why for both and how to get on
    assert tk._gluon_kernel({"kernel": "auto"}, False, 1, 128, _q(), kv16) is None
    assert tk._gluon_kernel({"kernel": "triton"}, False, 1, 128, _q(), kv16) is None
    with pytest.raises(ValueError, match="fp8 kernel: it is the decode kernel for fp8 pools; 16-bit kernel: needs a "
                                         "CUDA GPU.*kernel='triton'"):
        tk._gluon_kernel({"kernel": "gluon"}, False, 1, 128, _q(), kv16)
    with pytest.raises(ValueError, match="16-bit kernel: page size 32"):
        tk._gluon_kernel({"kernel": "gluon"}, False, 1, 128, _q(), torch.zeros(4, 32, 576, dtype=torch.bfloat16))


def test_decode_kernel_names_what_each_problem_runs(monkeypatch):
    # what `bench attention` prints per row: here (no GPU) always _mla_fwd; on an sm90 GPU (its availability faked)
    # the fp8 kernel for ≤ 32 rows over fp8, the seesaw / wide kernel for 64-row programs, _mla_fwd where none fits
    from pdlab.attention import gluon_mla
    from pdlab.attention.backends.triton_mla import decode_kernel

    def q(heads, q_len=1):
        return torch.zeros(2, q_len, heads, 576, dtype=torch.bfloat16)

    bf16, fp8 = torch.zeros(4, 64, 576, dtype=torch.bfloat16), torch.zeros(4, 64, 576, dtype=torch.uint8)
    assert decode_kernel(q(128), bf16) == "_mla_fwd"
    if not (W.HAVE_GLUON and gluon_mla.HAVE_GLUON):
        return
    monkeypatch.setattr(W, "available", lambda device, q_dtype=None: None)
    monkeypatch.setattr(gluon_mla, "available", lambda device, q_dtype=None: None)
    # 64-row programs: over a 16-bit pool the two-warpgroup schedule (the default); over fp8 too where its splits
    # hold more than 32 tiles (this fake GPU: 4 SMs), else the wide kernel; fp16 queries over fp8: the wide kernel
    assert decode_kernel(q(128), bf16) == "gluon_mla_seesaw" and decode_kernel(q(128), fp8) == "gluon_mla_seesaw_fp8"
    assert decode_kernel(q(16, 4), bf16) == "gluon_mla_seesaw"
    assert decode_kernel(q(128), bf16, {"seesaw": 0}) == "gluon_mla_wide"
    assert decode_kernel(q(128), fp8, {"seesaw": 0}) == "gluon_mla_wide"
    assert decode_kernel(q(128).half(), fp8) == "gluon_mla_wide"

    def table(pages):  # a block table of `pages` pages of 64 tokens per sequence
        return torch.zeros(2, pages, dtype=torch.int32)

    # 2 sequences × 2 head blocks on 4 SMs: one split; a split of 32 tiles (2k tokens) is too short, 33 is not
    assert decode_kernel(q(128), fp8, None, table(32)) == "gluon_mla_wide"
    assert decode_kernel(q(128), fp8, None, table(33)) == "gluon_mla_seesaw_fp8"
    assert decode_kernel(q(128), fp8, {"num_splits": 2}, table(66)) == "gluon_mla_seesaw_fp8"
    assert decode_kernel(q(128), fp8, {"num_splits": 3}, table(66)) == "gluon_mla_wide"
    assert decode_kernel(q(128), bf16, None, table(1)) == "gluon_mla_seesaw"  # 16-bit pools: whatever the splits
    assert decode_kernel(q(16), fp8) == "gluon_mla" and decode_kernel(q(16), bf16) == "_mla_fwd"
    assert decode_kernel(q(128), torch.zeros(4, 16, 576, dtype=torch.bfloat16)) == "_mla_fwd"  # page 16
    assert decode_kernel(q(128), bf16, {"kernel": "triton"}) == "_mla_fwd"


def test_fp8_seesaw_pays_at_the_split_count_the_launch_takes():
    # more than 32 tiles a split at the launch's split count (CPU: 4 SMs): explicit num_splits, the automatic count,
    # or the waves rule's; without the batch or the pool's capacity (decode_kernel without a block table): it runs
    cpu = torch.device("cpu")
    pays = tk._fp8_seesaw_pays
    assert pays({}, 1, 128, cpu, 2, 33 * 64) and not pays({}, 1, 128, cpu, 2, 32 * 64)  # one split (4 programs)
    assert pays({"num_splits": 2}, 1, 128, cpu, 2, 66 * 64) and not pays({"num_splits": 2}, 1, 128, cpu, 2, 64 * 64)
    assert not pays({"num_splits": 3}, 1, 128, cpu, 2, 66 * 64)  # 22 tiles a split
    # waves 4.0: ⌈4 · 4 SMs / 4 programs⌉ = 4 splits; 8k tokens → 32 tiles a split (no), 16k → 64 (yes)
    assert not pays({"waves": 4.0}, 1, 128, cpu, 2, 8192) and pays({"waves": 4.0}, 1, 128, cpu, 2, 16384)
    # S_q 2 at 128 heads: 4 head blocks a sequence, 8 programs on 4 SMs → the automatic rule's count
    splits = W.auto_splits(2, 4, 4096, 4, True)
    assert pays({}, 2, 128, cpu, 2, 4096) == (-(-64 // splits) > W.SEESAW_FP8_MIN_TILES)
    assert pays({}, 1, 128, cpu, None, None) and pays({}, 1, 128, cpu, 2, None)


def test_auto_splits_known_answers():
    # H200: 132 SMs, one program per SM; the counts the H200 timings and the tuner chose (2026-12-01_gluon_wide):
    # B=128 at 128 heads: 256 programs, ~2 waves, one split at 1k–16k (2 splits: 5–33 % slower); B=64: one;
    # B=32: 64 programs would leave half the SMs idle → 2; B=8: 8 splits at 1k and 16k (1k: 0.030 → 0.020 ms)
    for capacity in (1024, 4096, 8192, 16384):
        assert W.auto_splits(128, 2, capacity, 132) == 1
    assert W.auto_splits(64, 2, 8192, 132) == 1 and W.auto_splits(64, 2, 16384, 132) == 1
    assert W.auto_splits(32, 2, 8192, 132) == 2
    assert W.auto_splits(8, 2, 1024, 132) == 8 and W.auto_splits(8, 2, 16384, 132) == 8
    assert W.auto_splits(128, 1, 8192, 132) == 1  # 64 heads or 16 heads × S_q 4: one head block
    # a lone sequence: as many programs as fit in one wave, up to 32 splits, past 32 while each split keeps 4 tiles
    assert W.auto_splits(1, 2, 4096, 132) == 32 and W.auto_splits(1, 2, 8192, 132) == 32
    assert W.auto_splits(1, 2, 16384, 132) == 64 and W.auto_splits(1, 2, 32768, 132) == 64
    assert W.auto_splits(1, 2, 1024, 132) == 16  # never fewer than one tile per split
    assert W.auto_splits(1, 2, 128, 132) == 1  # two tiles: a partial costs more than the second tile
    # the two-warpgroup kernel takes at most 32 (B=1 at 4k–16k: 32 splits 14–28 % faster than 64 on an H200)
    for capacity in (4096, 8192, 16384, 32768):
        assert W.auto_splits(1, 2, capacity, 132, seesaw=True) == 32
    assert W.auto_splits(1, 2, 1024, 132, seesaw=True) == 16
    assert W.auto_splits(8, 2, 8192, 132, seesaw=True) == 8 and W.auto_splits(128, 2, 8192, 132, seesaw=True) == 1


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
def test_launcher_caps_the_splits_by_the_kernel_it_runs():
    # the op's launch as `kernel_resources` records it for an sm90 GPU of 132 SMs (on CPU): one sequence at 16k, 128
    # heads — the two-warpgroup kernel over bf16 gets 32 splits; the wide kernel (seesaw off, or an fp8 pool) 64
    from pdlab.bench.kernel_resources import record_launch

    def splits(kv, config):
        (stage, launch), = record_launch(128, kv, config, 90, batch=1, seqlen=16384)
        return launch["fn"].__name__, launch["splits"]

    from pdlab.attention.backends.triton_mla import DECODE_DEFAULT

    assert splits("bf16", dict(DECODE_DEFAULT)) == ("_mla_seesaw_decode", 32)
    assert splits("bf16", {**DECODE_DEFAULT, "seesaw": 0}) == ("_mla_wide_decode", 64)
    # over fp8 a lone 16k sequence's splits are short (8 or 16 tiles): the wide kernel; at 128k the two-warpgroup
    # one (32 splits of 64 tiles)
    assert splits("fp8", dict(DECODE_DEFAULT)) == ("_mla_wide_decode", 64)
    (_, launch), = record_launch(128, "fp8", dict(DECODE_DEFAULT), 90, batch=1, seqlen=131072)
    assert (launch["fn"].__name__, launch["splits"]) == ("_mla_seesaw_fp8_decode", 32)


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
def test_descriptor_describes_the_pool_and_keeps_nothing_alive():
    import gc
    import weakref

    kv = torch.zeros(6, 64, 576, dtype=torch.bfloat16)
    d = W.kv_descriptor(kv)
    assert list(d.shape) == [6 * 64, 576] and list(d.block_shape) == [64, 64] and d.base.data_ptr() == kv.data_ptr()
    assert W.kv_descriptor(torch.zeros(2, 128, 576, dtype=torch.uint8)).layout.swizzle_byte_width == 64
    # nothing inside the module keeps a descriptor, or through it a view of the pool (a server frees and reallocates
    # pools): once the caller lets go of the descriptor, the view it holds is gone
    view = weakref.ref(d.base)
    del d
    gc.collect()
    assert view() is None


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("dtype,page,swizzle", [(torch.bfloat16, 64, 128), (torch.uint8, 128, 64)])
def test_latent_descriptor_sees_each_tile_latent_as_its_eight_panels(dtype, page, swizzle):
    # [8, P·page, 64]: element (c, t, j) is column 64c + j of token t, so one [8, 64, 64] box at (0, row, 0) is the
    # tile's latent as the eight [64, 64] panels the MMAs read (the panels of a 2-D [64, 512] tile, one after the other)
    kv = torch.arange(5 * page * 576, dtype=torch.int32).reshape(5, page, 576).to(dtype)
    d = W.latent_descriptor(kv)
    assert list(d.shape) == [8, 5 * page, 64] and list(d.strides) == [64, 576, 1]
    assert list(d.block_shape) == [8, 64, 64] and d.base.data_ptr() == kv.data_ptr()
    assert d.layout.rank == 3 and d.layout.swizzle_byte_width == swizzle
    assert d.layout.swizzle_byte_width == W.kv_descriptor(kv).layout.swizzle_byte_width
    flat = kv.view(5 * page, 576)
    row = 2 * page + 64 if page == 128 else 3 * page  # a tile: its first token's row
    box = d.base[:, row:row + 64, :]
    assert torch.equal(torch.cat(list(box), dim=1), flat[row:row + 64, :512])


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
def test_launch_refuses_what_it_cannot_take():
    B, H = 2, 128
    bt, sl = torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    out, lse = torch.empty(B, H, 512), torch.empty(B, H, 1)

    def go(q, kv):
        W.launch(q, kv, bt, sl, out, lse, out, lse, (H, 1, 1), (0,) * 5, 1.0, q_per_seq=1, splits=1)

    with pytest.raises(ValueError, match="page size 16"):
        go(_q(), torch.zeros(4, 16, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="reads bf16, fp16 or fp8"):
        go(_q(dtype=torch.float32), torch.zeros(4, 64, 576, dtype=torch.float32))
    with pytest.raises(ValueError, match="must be contiguous"):
        go(_q(), torch.zeros(4, 64, 1152, dtype=torch.bfloat16)[:, :, :576])
    with pytest.raises(ValueError, match=r"conv_group=2: .* 1 / 3 / 9 at a time"):
        W.launch(_q(), torch.zeros(4, 64, 576, dtype=torch.uint8), bt, sl, out, lse, out, lse, (H, 1, 1), (0,) * 5, 1.0,
                 q_per_seq=1, splits=1, conv_group=2)


_COMPILE = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from pdlab.bench.kernel_resources import _disassemble, _ptxas_usage, sass_opcodes
from pdlab.attention import gluon_mla_wide as W
final, fp8, tma3 = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[4] == "1"
names = W._mla_wide_decode.arg_names
kv = torch.zeros(8, 64, 576, dtype=torch.uint8 if fp8 else torch.bfloat16)
desc, lat = W.kv_descriptor(kv), W.latent_descriptor(kv)
elem = 'u8' if fp8 else 'bf16'
ptrs = {"Q": "*bf16", "BT": "*i32", "SEQLENS": "*i32", "O": "*bf16", "LSE": "*fp32", "O_PART": "*fp32",
        "LSE_PART": "*fp32", "KV_SCALE_PTR": "*i32",
        "kv_desc": f"tensordesc<{elem}[64, 64],{desc.layout!r}>",
        "lat_desc": (f"tensordesc<{elem}[8, 64, 64],{lat.layout!r}>" if tma3
                     else f"tensordesc<{elem}[64, 64],{desc.layout!r}>")}
sig = {n: ptrs.get(n, "fp32" if n in ("qk_scale", "kv_scale") else "i32") for n in names}
consts = {"Q_PER_SEQ": 1, "BLOCK_H": 64, "PAGE": 64, "FINAL": final, "FP8": fp8, "SCALE_FROM_PTR": False,
          "CONV_GROUP": int(sys.argv[3]), "TMA3": tma3}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n].startswith("*") or n.startswith("stride")}
sig.update({k: "constexpr" for k in consts})
k = triton.compile(GluonASTSource(fn=W._mla_wide_decode, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": W.WARPS, "num_stages": 1})
regs, spill = _ptxas_usage(k.asm["ptx"], 90)
sass = _disassemble(k.asm["cubin"])
ops = {}
for line in sass.splitlines():
    for name in ("HGMMA.64x32x16.F32", "HGMMA.64x256x16.F32", "UTMALDG.2D", "UTMALDG.3D",
                 "F2FP.F16.E4M3.UNPACK_B", "BAR.SYNC"):
        if name in line:
            ops[name] = ops.get(name, 0) + 1
print(json.dumps({"shared": k.metadata.shared, "regs": regs, "spill": spill, "ops": ops}))
"""


def _compiled(final, fp8, group, tma3) -> dict:
    """The wide kernel compiled for sm90 in its own process: shared bytes, registers, spills, SASS op counts."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(int(final)), str(int(fp8)), str(group), str(int(tma3))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("final,fp8,group,tma3", [
    (True, False, 9, True), (False, False, 9, True), (True, False, 9, False),
    (True, True, 1, True), (True, True, 3, False), (True, True, 9, True),
])
def test_compiles_for_sm90_one_program_per_sm(final, fp8, group, tma3):
    # compiled for sm90 on any machine (its own process): q·k as 32 + 4 wgmma of 64×32 per warpgroup (one chain per
    # tile), p·v as 4 wgmma of 64×256 with p from registers, the tiles by TMA (9 boxes, or the latent as one 3-D
    # box and the rope block, issued where the ring is filled and refilled), no spills; q and two tiles fit one SM's
    # shared memory. Over an fp8 pool each thread converts its 144 bytes of a tile once (72 e4m3x2 conversions)
    # into the MMAs' fp16 tile, in any conversion group
    got = _compiled(final, fp8, group, tma3)
    ops = got["ops"]
    assert ops["HGMMA.64x32x16.F32"] == 36 and ops["HGMMA.64x256x16.F32"] == 4, ops
    assert ops.get("F2FP.F16.E4M3.UNPACK_B", 0) == (72 if fp8 else 0), ops
    if tma3:  # one 3-D box and one 2-D box per fill
        assert ops["UTMALDG.3D"] == ops["UTMALDG.2D"] >= 1, ops
    else:
        assert ops["UTMALDG.2D"] >= 9 and ops["UTMALDG.2D"] % 9 == 0 and "UTMALDG.3D" not in ops, ops
    assert got["spill"] == 0, got
    assert W.shared_bytes(fp8=fp8) <= got["shared"] <= SM90.shared_per_program, got
    assert W.programs_per_sm() == 1


@pytest.mark.skipif(not W.HAVE_GLUON, reason="this Triton has no Gluon")
def test_one_latent_box_takes_the_copies_barriers_out():
    # Triton puts a CTA barrier after each TMA copy: a fill of nine boxes (two in the prologue, one in the loop)
    # costs seven barriers more than a fill of one latent box and the rope block
    nine, one = (_compiled(True, False, 9, tma3)["ops"] for tma3 in (False, True))
    assert nine["BAR.SYNC"] - one["BAR.SYNC"] >= 2 * 7, (nine, one)


# ---------------------------------------------------------------------------------------------------- GPU

def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return W.available(torch.device("cuda"))


def _lens(B, top, q_len, rng):
    fixed = [q_len, 63, 64, 65, 128, 129, top]
    return [max(q_len, n) for n in fixed + [rng.randint(1, top) for _ in range(B - len(fixed))]]


# measured on an H200: the fp8 seesaw kernel's score of a lone visible token is off by at most 2^-12.8 of
# softmax_scale·Σ|q_i·k_i| (120 problems, rows scaled by 1, 1e3 and 3e5); the bound below allows 2^-10
SCORE_ROUNDING = 2.0 ** -10


def _assert_within_score_rounding(out, q, rows, scale, rel=SCORE_ROUNDING):
    """One sequence's output out [n_q, H, 512] (the kernel's) against the fp32 reference when each score may be off
    by E = rel·scale·max_j Σ_i |q_i·k_ji|: a row may move weight between tokens whose scores lie within 2E of its
    maximum, nothing else. q [n_q, H, 576] at the last n_q positions of rows [L, 576] (fp32, dequantized).
    With scores s' = s + e, |e| ≤ E: o' − o = Σ_j (p'_j − p_j)(v_j − v_top) and |p'_j − p_j| ≤ exp(s_j − s_top + 2E)
    (capped at 1), so ‖o' − o‖ ≤ Σ_j≠top min(1, exp(s_j − s_top + 2E))·‖v_j − v_top‖; plus 2^-8·‖o‖ for the bf16
    output (2^-9) and fp16 p. A row whose other tokens score far below its top is held to that rounding alone."""
    q, k = q.double(), rows.double()
    n_q, L = q.shape[0], k.shape[0]
    v = k[:, :512]
    s = torch.einsum("qhd,ld->qhl", q, k) * scale
    E = torch.einsum("qhd,ld->qhl", q.abs(), k.abs()).amax(-1, keepdim=True) * scale * rel
    hidden = torch.arange(L)[None, None, :] >= (L - n_q + 1 + torch.arange(n_q))[:, None, None]
    s = s.masked_fill(hidden, float("-inf"))
    ref = torch.softmax(s, -1) @ v
    top = s.argmax(-1)
    weight = torch.exp(torch.clamp(s - s.amax(-1, keepdim=True) + 2 * E, max=0))  # 0 for hidden tokens
    spread = (v[None, None] - v[top][:, :, None]).norm(dim=-1)  # [n_q, H, L]; 0 at the top token
    bound = (weight * spread).sum(-1) + 2.0 ** -8 * ref.norm(dim=-1)
    err = (out.double().cpu() - ref).norm(dim=-1)
    assert (err <= bound).all(), f"rows off beyond the score rounding: {(err > bound).nonzero().tolist()[:8]}, " \
        f"worst error / bound {(err / bound).max().item():.3g}"


def test_score_rounding_bound_tells_a_tie_from_a_wrong_token():
    # three tokens: 0 and 1 tie at the top far above 2 (scores ~1e4, E ~ 10); a row may split 0/1 any way,
    # never give 2 weight, and a row whose top is alone may not move at all
    torch.manual_seed(0)
    k = torch.randn(3, 576)
    k[1] = k[0] + 1e-3 * torch.randn(576)  # near-tied with token 0 for any q
    k[2] = -k[0]
    q = (200 * k[0]).expand(1, 2, 576).clone()  # [n_q 1, H 2, 576]
    scale = 576 ** -0.5
    v = k[:, :512].double()
    _assert_within_score_rounding((0.5 * (v[0] + v[1])).expand(1, 2, 512), q, k, scale)
    _assert_within_score_rounding(v[1].expand(1, 2, 512), q, k, scale)
    with pytest.raises(AssertionError, match="beyond the score rounding"):
        _assert_within_score_rounding(v[2].expand(1, 2, 512), q, k, scale)
    with pytest.raises(AssertionError, match="beyond the score rounding"):
        _assert_within_score_rounding((0.9 * v[0] + 0.1 * v[2]).expand(1, 2, 512), q, k, scale)
    alone = k[[0, 2]]  # no tie: the top token's V or bust
    _assert_within_score_rounding(v[0].expand(1, 2, 512), q, alone, scale)
    with pytest.raises(AssertionError, match="beyond the score rounding"):
        _assert_within_score_rounding((0.97 * v[0] + 0.03 * v[2]).expand(1, 2, 512), q, alone, scale)
    # the causal mask: of two new tokens the first sees only token 0
    q2 = (200 * k[2]).expand(2, 1, 576).clone()
    two = k[[0, 2]]
    _assert_within_score_rounding(torch.stack([v[0], v[2]])[:, None], q2, two, scale)
    with pytest.raises(AssertionError, match="beyond the score rounding"):
        _assert_within_score_rounding(torch.stack([v[2], v[2]])[:, None], q2, two, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,page,cfg", [
    (128, 1, 64, {}), (128, 1, 64, {"num_splits": 1}), (128, 1, 128, {"num_splits": 3}), (64, 1, 64, {}),
    (128, 2, 64, {}), (32, 2, 128, {"num_splits": 5}), (16, 4, 64, {}), (128, 4, 64, {"num_splits": 2}),
    (128, 1, 64, {"waves": 4.0}), (256, 1, 64, {}),
    (128, 1, 64, {"num_splits": 64}),  # splits past the end of short sequences: empty partials
    (128, 1, 64, {"seesaw": 0}), (128, 2, 128, {"seesaw": 0, "num_splits": 3}), (16, 4, 64, {"seesaw": 0}),
    (128, 1, 64, {"seesaw": 0, "tma3": 0}), (128, 2, 128, {"seesaw": 0, "tma3": 0, "num_splits": 3}),  # nine boxes
    (128, 1, 64, {"num_splits": 2}),
])
def test_gpu_wide_decode_matches_the_reference(heads, q_len, page, cfg, seed):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = decode_problem(_lens(24, 3000, q_len, rng), heads, q_len, page, torch.bfloat16, device="cuda", seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, backend="torch")
    out, lse = mla_decode(*args, backend="triton", config={"kernel": "gluon", **cfg})
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,page,cfg,q_dtype", [
    (128, 1, 64, {}, torch.bfloat16), (128, 1, 64, {"num_splits": 3}, torch.bfloat16),
    (128, 2, 128, {}, torch.bfloat16), (16, 4, 64, {"num_splits": 2}, torch.float16), (64, 1, 64, {}, torch.float16),
    (128, 1, 64, {"num_splits": 64}, torch.bfloat16), (128, 1, 64, {"conv_group": 1}, torch.bfloat16),
    (128, 2, 128, {"conv_group": 3, "num_splits": 3}, torch.float16), (128, 1, 128, {"tma3": 0}, torch.bfloat16),
    (128, 1, 64, {"seesaw": 0}, torch.bfloat16),  # the wide kernel (its fp8 splits are short here anyway)
])
def test_gpu_wide_decode_over_fp8_matches_the_reference(heads, q_len, page, cfg, q_dtype, seed):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = decode_problem(_lens(24, 3000, q_len, rng), heads, q_len, page, q_dtype, kv_dtype="fp8", device="cuda",
                       seed=seed)  # e4m3 bytes, NaN (0x7F) past each length
    if q_dtype == torch.bfloat16:
        p.q[0] *= 3e5  # rows far beyond fp16's range: rescaled per row by a power of two
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, kv_scale=p.kv_scale, backend="torch")
    scale_t = torch.tensor([p.kv_scale], device="cuda")
    for scale in (p.kv_scale, scale_t):
        out, lse = mla_decode(*args, kv_scale=scale, backend="triton", config={"kernel": "gluon", **cfg})
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
            (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,page,cfg,top", [
    (128, 1, 64, {"num_splits": 1}, 3000), (128, 1, 128, {}, 16000), (128, 2, 64, {"num_splits": 1}, 3000),
    (16, 4, 128, {"num_splits": 1}, 3000), (64, 1, 64, {"num_splits": 2}, 6000),
])
def test_gpu_seesaw_decode_over_fp8_matches_the_reference(heads, q_len, page, cfg, top, seed):
    # splits of more than 32 tiles: the two-warpgroup fp8 kernel (asserted), against the reference on the same bytes;
    # 24 sequences up to 16k with automatic splits: 5 of 50 tiles (at 9k it would be 5 of 29: the wide kernel)
    from pdlab.attention.backends.triton_mla import decode_kernel

    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = decode_problem(_lens(24, top, q_len, rng), heads, q_len, page, torch.bfloat16, kv_dtype="fp8", device="cuda",
                       seed=seed)  # e4m3 bytes, NaN (0x7F) past each length
    p.q[0] *= 3e5  # rows far beyond fp16's range: rescaled per row by a power of two
    config = {"kernel": "gluon", **cfg}
    assert decode_kernel(p.q, p.kv_cache, config, p.block_table) == "gluon_mla_seesaw_fp8"
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, kv_scale=p.kv_scale, backend="torch")
    rows0 = _rows(p.kv_cache.cpu(), p.block_table[0].cpu(), q_len, p.kv_scale)
    for scale in (p.kv_scale, torch.tensor([p.kv_scale], device="cuda")):
        out, lse = mla_decode(*args, kv_scale=scale, backend="triton", config=config)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        assert cosine_error(out[1:], ref[0][1:]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
            (cosine_error(out[1:], ref[0][1:]), cosine_error(lse, ref[1]))
        # the scaled sequence (q_len tokens): scores near 1e6, where the e4m3 accumulators' rounding (about 2^-13
        # of Σ|q·k|) reweighs near-tied tokens (seen: two tokens 2.7 apart, that row 9.8 % off, cosine error 6.6e-5)
        _assert_within_score_rounding(out[0], p.q[0].cpu(), rows0, p.softmax_scale)


@pytest.mark.gpu
def test_gpu_wide_decode_fp16_and_cuda_graph(seed):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = decode_problem(_lens(16, 8192, 1, rng), 128, 1, 64, torch.float16, device="cuda", seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, backend="torch")
    cfg = {"kernel": "gluon"}
    out, lse = mla_decode(*args, backend="triton", config=cfg)
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout, glse = mla_decode(*args, backend="triton", config=cfg)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, out) and torch.equal(glse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_default_decode_at_128_heads_runs_the_wide_kernel(kv, seed, monkeypatch):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    calls = []
    real = W.launch
    monkeypatch.setattr(W, "launch", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    p = decode_problem([100, 5000], 128, 1, 64, torch.bfloat16, kv_dtype="fp8" if kv == "fp8" else "same",
                       device="cuda", seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    out, _ = mla_decode(*args, kv_scale=p.kv_scale, backend="triton", config={})
    assert len(calls) == 1
    assert cosine_error(out, mla_decode(*args, kv_scale=p.kv_scale, backend="torch")[0]) < 1e-5
