"""The fragment-order NVFP4 decode GEMMs (moe/triton/nvfp4_frag.py): the weight and scale packing on CPU (every
byte and scale where the kernel's register layout expects it), the path choice, compilation for sm90 with the
installed Triton's Gluon, and on an H200 the experts against the fp32 reference."""

import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined (the activation pre-kernel)

from pdlab.moe.triton import nvfp4_frag as F  # noqa: E402


def _fragment_model(wp: torch.Tensor, sp: torch.Tensor):
    """What each thread of the kernel holds, rebuilt from the packed tensors by the layout the kernel declares
    (wgmma A fragment: thread t = 32w + l, rows 16w + l//4 (+8, +64), MMA columns 16c + 2q + u (+8)):
    ([E, N, K] nibble codes, [E, N, K] block scale bytes) in MMA column order."""
    E, NT, KT = wp.shape[:3]
    codes = torch.zeros(E, NT * 128, KT * 128, dtype=torch.uint8)
    scales = torch.zeros(E, NT * 128, KT * 128, dtype=torch.uint8)
    for i16 in range(4):
        for b in range(16):
            i = 16 * i16 + b
            u, rsel, c, rhi = i % 2, (i // 2) % 2, (i // 4) % 8, i // 32
            for t in range(128):
                w, lane = t // 32, t % 32
                q = lane % 4
                row = 16 * w + lane // 4 + 8 * rsel + 64 * rhi
                sidx = rsel + 2 * (c // 4) + 4 * rhi
                for nt in range(NT):
                    for kt in range(KT):
                        byte = wp[:, nt, kt, i16, t, b]
                        r, col = nt * 128 + row, kt * 128 + 16 * c + 2 * q + u
                        codes[:, r, col] = byte & 0xF
                        codes[:, r, col + 8] = byte >> 4
                        scales[:, r, col] = scales[:, r, col + 8] = sp[:, nt, kt, t, sidx]
    return codes, scales


def test_packing_puts_every_nibble_and_scale_where_the_fragments_read_it():
    g = torch.Generator().manual_seed(0)
    E, N, K = 2, 256, 256
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    sf = torch.randint(0, 256, (E, N, K // 16), dtype=torch.uint8, generator=g)
    wp, sp = F.pack_weights(w), F.pack_scales(sf)
    assert wp.shape == (E, 2, 2, 4, 128, 16) and sp.shape == (E, 2, 2, 128, 8)
    assert torch.equal(F.unpack_weights(wp), w)
    codes, scales = _fragment_model(wp, sp)
    order = F.column_order(K)  # MMA column → model column
    model_codes = torch.stack([w & 0xF, w >> 4], -1).reshape(E, N, K)
    assert torch.equal(codes, model_codes[:, :, order])
    model_scales = sf.repeat_interleave(16, dim=-1)
    assert torch.equal(scales, model_scales[:, :, order])


def test_k_order_is_a_permutation_with_the_kernels_inverse():
    pk = F.perm_k()
    assert sorted(pk.tolist()) == list(range(128))
    # the gate_up epilogue writes model column k' of the intermediate at MMA column 16c + 8n + 2q + u
    kk = torch.arange(128)
    inv = 16 * ((kk // 4) % 8) + 8 * ((kk // 2) % 2) + 2 * (kk // 32) + kk % 2
    assert torch.equal(pk[inv], kk)
    # the activations (_prep_x) put model column 32q + 4c + 2n + u at MMA column mk
    mk = torch.arange(128)
    read = 32 * ((mk // 2) % 4) + 4 * (mk // 16) + 2 * ((mk // 8) % 2) + mk % 2
    assert torch.equal(read, pk)
    # the two scale blocks of a thread's row: its 32 model columns are consecutive
    assert all(len({int(pk[16 * c + 8 * n + 2 * q + u]) // 16 for c in range(8) for n in range(2) for u in range(2)})
               == 2 for q in range(4))


def test_experts_stored_in_fragment_order_in_place():
    # frag_(): same tensors' shapes, bytes = pack_weights / pack_scales; the modelopt bytes come back from
    # plain_nvfp4() (also from tiled, and to tiled and back); dequantised values unchanged
    from pdlab.moe.weights import ExpertWeights

    w = ExpertWeights.from_bf16(torch.randn(3, 512, 256) * 0.1, torch.randn(3, 256, 256) * 0.1, quantize=True)
    plain = {k: v.view(torch.uint8).clone() for k, v in w.plain_nvfp4().items()}
    before = w.dequantized(torch.float32)
    w.tile_().frag_()
    assert w.nvfp4_layout == "fragment" and w.w13_weight.shape == plain["w13_weight"].shape
    assert torch.equal(w.w13_weight.view(-1), F.pack_weights(plain["w13_weight"]).view(-1))
    assert torch.equal(w.w2_weight_scale.view(torch.uint8).view(-1),
                       F.pack_scales(plain["w2_weight_scale"]).view(-1))
    for k, v in w.plain_nvfp4().items():
        assert torch.equal(v.view(torch.uint8), plain[k]), k
    assert all(torch.equal(a, b) for a, b in zip(w.dequantized(torch.float32), before))
    w.tile_()
    assert w.nvfp4_tiled and all(torch.equal(v.view(torch.uint8), plain[k]) for k, v in w.plain_nvfp4().items())
    w.store_("fragment").store_("modelopt")  # back to the bytes as loaded, in place
    assert w.nvfp4_layout == "modelopt" and torch.equal(w.w13_weight, plain["w13_weight"])
    assert torch.equal(w.w2_weight_scale.view(torch.uint8), plain["w2_weight_scale"])
    with pytest.raises(ValueError, match="unknown NVFP4 layout"):
        w.store_("frag")
    with pytest.raises(ValueError, match="multiples of 128"):
        ExpertWeights.from_bf16(torch.randn(1, 128, 64), torch.randn(1, 64, 64), quantize=True).frag_()


def test_dequantise_from_fragment_order():
    # the dense path's NVFP4 → bf16 kernel reading fragment order gives the modelopt layout's values bit for bit
    from pdlab.moe.triton.nvfp4_dequant import nvfp4_to_bf16
    from pdlab.moe.weights import ExpertWeights

    dev = "cuda" if CUDA else "cpu"
    w = ExpertWeights.from_bf16(torch.randn(2, 256, 384, device=dev) * 0.1, torch.randn(2, 384, 128, device=dev) * 0.1,
                                quantize=True)
    plain = {k: v.view(torch.uint8).clone() for k, v in w.plain_nvfp4().items()}
    want = [nvfp4_to_bf16(plain[f"{p}_weight"], plain[f"{p}_weight_scale"], getattr(w, f"{p}_weight_scale_2"))
            for p in ("w13", "w2")]
    w.frag_()
    for p, ref in zip(("w13", "w2"), want):
        got = nvfp4_to_bf16(getattr(w, f"{p}_weight"), getattr(w, f"{p}_weight_scale").view(torch.uint8),
                            getattr(w, f"{p}_weight_scale_2"), frag=True)
        assert torch.equal(got, ref), p


def test_packing_refuses_shapes_that_do_not_tile():
    with pytest.raises(ValueError, match="multiples of 128"):
        F.pack_weights(torch.zeros(1, 100, 64, dtype=torch.uint8))


def test_path_choice_without_a_hopper_gpu():
    from pdlab.moe.layouts import Masked
    from pdlab.moe.runners.triton_nvfp4 import frag_path_taken
    from pdlab.moe.weights import ExpertWeights

    w = ExpertWeights.from_bf16(torch.randn(2, 256, 128) * 0.1, torch.randn(2, 128, 128) * 0.1, quantize=True)
    layout = Masked(torch.randn(2, 4, 128), torch.tensor([4, 1], dtype=torch.int32))
    if not CUDA:
        assert F.available(torch.device("cpu")) == "needs a CUDA GPU" or not F.HAVE_GLUON
        assert not frag_path_taken(layout, w, {"FRAG": 1})
    assert not frag_path_taken(layout, w, {"FRAG": 0})


def test_kernel_path_names_what_the_triton_runner_runs():
    # what `bench moe_experts` prints per triton row: the config run_experts would resolve, then the runner's choice
    from pdlab.moe.experts import resolved_config
    from pdlab.moe.layouts import Contiguous, Masked
    from pdlab.moe.runners.triton_nvfp4 import kernel_path
    from pdlab.moe.weights import ExpertWeights

    w = ExpertWeights.from_bf16(torch.randn(2, 256, 128) * 0.1, torch.randn(2, 128, 128) * 0.1, quantize=True)
    masked = Masked(torch.randn(2, 4, 128), torch.tensor([4, 1], dtype=torch.int32))
    cfg, source = resolved_config(masked, w, "triton", None, 4)
    assert cfg["_expected_m"] == 4 and (source == "default" or source.startswith("tuned"))
    assert kernel_path(masked, w, cfg) == ("fragment" if F.available(torch.device("cuda" if CUDA else "cpu")) is None
                                           and not os.environ.get("TRITON_INTERPRET") else "in-loop")
    assert kernel_path(masked, w, resolved_config(masked, w, "triton", {"FRAG": 0}, 4)[0]) == "in-loop"
    rows = Contiguous(torch.randn(600, 128, dtype=torch.bfloat16), torch.tensor([300, 300], dtype=torch.int32),
                      torch.tensor([0, 300, 600], dtype=torch.int32))
    dense, source = resolved_config(rows, w, "triton", {"DENSE_MIN_M": 256}, 300)
    assert source == "explicit"
    assert kernel_path(rows, w, dense) == ("dense" if hasattr(torch, "_grouped_mm") else "in-loop")
    assert kernel_path(rows, w, resolved_config(rows, w, "triton", {"DENSE_MIN_M": 0}, 300)[0]) == "in-loop"


_COMPILE = r"""
import json, os, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from pdlab.bench.kernel_resources import _disassemble, sass_opcodes
from pdlab.moe.triton import nvfp4_frag as F
contig = sys.argv[1] == "contiguous"
listed = sys.argv[1] != "masked"  # "slab": a masked slab run as a block list
sig = {"wp": "*u8", "sp": "*u8", "x_ptr": "*fp16", "out_ptr": "*bf16", "cnt_ptr": "*i32", "s2_ptr": "*fp32",
       "K": "i32", "N_OUT": "i32", "M_MAX": "i32", "up_tiles": "i32", "stride_xe": "i32", "stride_xm": "i32",
       "stride_oe": "i32", "stride_om": "i32", "offs_ptr": "*i32", "NUM_E": "i32"}
consts = {"BM": 16, "FUSE_SILU": False, "OUT_PERMUTED": False, "UNROLL": 1, "CONTIG": contig, "E_POW2": 128,
          "X_ASYNC": sys.argv[2] == "1", "W_STAGES": int(sys.argv[3]), "PAIR_N": False,
          "PDL": sys.argv[5:6] == ["1"], "X_RING": sys.argv[4:5] == ["1"], "MMA_ASYNC": sys.argv[6:7] == ["1"],
          "LIST": listed}
attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
         if v.startswith("*") or k in ("K", "N_OUT", "stride_xe", "stride_xm", "stride_oe", "stride_om")}
sig.update({k: "constexpr" for k in consts})
k = triton.compile(GluonASTSource(fn=F._frag_gemm, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
sass = _disassemble(k.asm["cubin"])
marks = [w.split(".")[0] for line in sass.splitlines() for w in line.replace(";", " ").split()
         if w.split(".")[0] in ("LDGSTS", "ACQBULK", "PREEXIT", "STG", "EXIT")]
waits = sorted({line.split("gsb0,")[1].split(";")[0].strip() for line in sass.splitlines()
                if "WARPGROUP.DEPBAR.LE" in line})
print(json.dumps({"shared": k.metadata.shared, "ops": sass_opcodes(sass), "marks": marks, "gmma_waits": waits}))
"""


def _compile_sm90(layout: str, x_async: int, w_stages: int, x_ring: int = 0, pdl: int = 0,
                  mma_async: int = 0) -> dict:
    """The down GEMM (BM 16) compiled for sm90 in its own process (compiled, not interpreted): shared bytes, the
    SASS opcode counts, the order of its copies, grid-dependency instructions, stores and exits ("marks"), and the
    MMA-group counts its wgmma waits allow in flight ("gmma_waits")."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE, layout, str(x_async), str(w_stages), str(x_ring), str(pdl),
                        str(mma_async)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(not F.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("x_async", [0, 1])
@pytest.mark.parametrize("layout", ["masked", "slab", "contiguous"])
def test_compiles_for_sm90_without_shared_memory_for_the_weights(layout, x_async):
    # weights through registers: the only shared memory is the activation tile (BM × 128 fp16) and, for a block
    # list (contiguous rows, or a slab run as one), the block search's reduction scratch; the weight path has no
    # byte permutes beyond the scales'
    got = _compile_sm90(layout, x_async, 0)
    ops = got["ops"]
    assert got["shared"] <= (2 if x_async else 1) * 16 * 128 * 2 + 1024  # x_async: a two-tile ring
    # the block search's cross-warp scan and sums; cp.async adds never-executed `@!PT LDS RZ, [RZ]` padding
    lds = (0 if layout == "masked" else 7) + (12 if x_async else 0)  # Triton 3.6: 7, 3.9: 4
    assert ops["HGMMA"] == 16 and ops.get("LDS", 0) <= lds and ops.get("LDSM", 0) == 0, ops
    assert ops.get("LDGSTS", 0) == (4 if x_async else 0), ops  # a tile's two 16-byte copies: before and in the loop
    assert ops.get("PRMT", 0) <= 16, ops


@pytest.mark.skipif(not F.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("w_stages", [2, 4])
def test_compiles_for_sm90_with_the_weight_ring(w_stages):
    # the weight tiles through a cp.async ring: w_stages slots of one tile's bytes (8 KB) and scales (1 KB) beside
    # the activation tile; each tile is four 16-byte and one 8-byte copies per thread (w_stages - 1 tiles before
    # the loop, one in it) and as many shared loads back; still no byte permutes beyond the scales'
    got = _compile_sm90("masked", 0, w_stages)
    ops = got["ops"]
    assert got["shared"] == w_stages * (8192 + 1024) + 16 * 128 * 2, got
    assert ops["HGMMA"] == 16 and ops.get("LDSM", 0) == 0, ops
    assert ops.get("LDGSTS", 0) == 5 * w_stages, ops
    assert ops.get("PRMT", 0) <= 16, ops


@pytest.mark.skipif(not F.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("w_stages", [2, 3])
def test_compiles_for_sm90_with_activations_in_the_ring_and_pdl(w_stages):
    # X_RING: each ring slot holds a tile's weights and its activation tile [16, 128] fp16 (two 16-byte copies per
    # thread), and there is no separate activation buffer. PDL: the program first lets the next grid launch
    # (PREEXIT), copies the first tile's weights (five copies), then waits for the previous grid (ACQBULK) before
    # its first activation copy; nothing is stored before; programs without rows wait too (a second ACQBULK)
    got = _compile_sm90("masked", 0, w_stages, x_ring=1, pdl=1)
    ops, marks = got["ops"], got["marks"]
    assert got["shared"] == w_stages * (8192 + 1024 + 16 * 128 * 2), got
    assert ops["HGMMA"] == 16 and ops.get("LDGSTS", 0) == 7 * w_stages and ops.get("PRMT", 0) <= 16, ops
    assert marks[0] == "PREEXIT" and marks.count("ACQBULK") == 2, marks
    first_wait = marks.index("ACQBULK")
    assert marks[1:first_wait] == ["LDGSTS"] * 5 and "STG" not in marks[:first_wait], marks
    plain = _compile_sm90("masked", 0, w_stages)["marks"]
    assert "ACQBULK" not in plain and "PREEXIT" not in plain


@pytest.mark.skipif(not F.HAVE_GLUON, reason="this Triton has no Gluon")
def test_compiles_for_sm90_with_asynchronous_half_tile_mmas():
    # MMA_ASYNC: each tile's two 64-row halves are separate MMA groups (8 HGMMA each: the same 16 per tile) and the
    # program waits until at most one group is in flight (gsb0 ≤ 1) between them, so that a half's unpack overlaps
    # the previous half's MMA; the synchronous ring waits for every MMA (≤ 0 only). The same shared memory.
    got = _compile_sm90("masked", 0, 2, x_ring=1, mma_async=1)
    assert got["ops"]["HGMMA"] == 16 and got["shared"] == 2 * (8192 + 1024 + 16 * 128 * 2), got
    assert "0x1" in got["gmma_waits"], got["gmma_waits"]
    assert _compile_sm90("masked", 0, 2, x_ring=1)["gmma_waits"] == ["0x0"]


@pytest.mark.parametrize("permute", [True, False])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_activation_pre_kernel_matches_the_dequantised_rows(payload, permute):
    # the small kernel before the gate_up GEMM: each valid row's values (dequantised for fp8 / nvfp4) ·2^-8 in
    # fp16, MMA column mk holding model column perm_k(mk); rows past masked_m are not written. Both orderings:
    # rows read contiguously and reordered in registers (the default), or each column gathered from memory
    _check_pre_kernel(payload, permute, "cuda" if CUDA else "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("permute", [True, False])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_gpu_activation_pre_kernel_matches_the_dequantised_rows(payload, permute):
    _check_pre_kernel(payload, permute, "cuda")


def _check_pre_kernel(payload: str, permute: bool, dev: str) -> None:
    from pdlab.moe.layouts import Masked, dequantize_hidden, quantize_payload

    E, M, K = 3, 4, 256
    g = torch.Generator().manual_seed(1)
    x = torch.randn(E * M, K, generator=g) * 3
    if payload != "nvfp4":  # (its fixed global scale below is sized for small values)
        x[::3, 5::41] = 7e4  # past fp16's range; ·2^-8 is not
    x = x.to(dev)
    gs = torch.tensor([0.7], device=dev) if payload == "nvfp4" else None
    hidden, scales, gsc = quantize_payload(x.to(torch.bfloat16), payload, gs)
    layout = Masked(hidden.view(E, M, -1), torch.tensor([4, 1, 0], dtype=torch.int32, device=dev), payload,
                    None if scales is None else scales.view(E, M, -1), gsc)
    want = (dequantize_hidden(layout) * 2.0 ** -8).to(torch.float16)[..., F.column_order(K, dev)]
    # one program per slab row, then the slab's block list of 2-row blocks (expert 0 owns blocks 0 and 1, expert 1
    # block 2; programs past block 2 have no row)
    for block_m in (0, 2):
        y = F.prepare_activations(layout.hidden, layout.masked_m, payload, layout.scales, layout.global_scale,
                                  permute_in_registers=permute, block_m=block_m)
        for e, n in enumerate([4, 1, 0]):
            assert torch.equal(y[e, :n], want[e, :n]), (payload, e, block_m)
    # a block list bounded below its blocks (a producer's wrong max_rows) converts the first blocks' rows only
    y = F.prepare_activations(layout.hidden, layout.masked_m, payload, layout.scales, layout.global_scale,
                              permute_in_registers=permute, block_m=2, blocks=2)
    assert torch.equal(y[0], want[0])


def _record_launches(monkeypatch):
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    monkeypatch.setattr(F, "_frag_gemm", Recorder(), raising=False)
    return launches


def test_run_frag_launches_on_cpu(monkeypatch):
    # the host side of the two GEMM launches, with the Gluon kernel replaced by a recorder: grid (N tiles,
    # experts, token blocks), the per-expert weight_scale_2 as stored, the gate_up output (fp16, MMA K order)
    # handed to the down GEMM, down with two tiles' loads in flight
    from pdlab.moe.layouts import Masked
    from pdlab.moe.weights import ExpertWeights

    launches = _record_launches(monkeypatch)
    E, H, I, M = 2, 256, 256, 5  # down: K = I = two tiles, so its two-tile loads apply
    w = ExpertWeights.from_bf16(torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, quantize=True)
    packs = F.pack_experts(w.w13_weight, w.w13_weight_scale, w.w2_weight, w.w2_weight_scale,
                           w.w13_weight_scale_2, w.w2_weight_scale_2)
    assert torch.equal(packs["w13_s2"], w.w13_weight_scale_2.float())
    layout = Masked(torch.randn(E, M, H), torch.tensor([5, 2], dtype=torch.int32))
    out = F.run_frag(layout, packs, I, torch.bfloat16, 16, slab_list=False)
    (g1, a1, k1), (g2, a2, k2) = launches
    assert g1 == (I // 128, E, 1) and g2 == (H // 128, E, 1)
    assert a1[5] is packs["w13_s2"] and a2[5] is packs["w2_s2"]
    h = a1[3]
    assert h.dtype == torch.float16 and h.shape == (E, M, I) and a2[2] is h
    assert a1[2].dtype == torch.float16 and a1[2].shape == (E, M, H)  # the prepared activations
    assert k1 == {"BM": 16, "FUSE_SILU": True, "OUT_PERMUTED": True, "UNROLL": 1, "CONTIG": False, "E_POW2": 128,
                  "X_ASYNC": False, "W_STAGES": 0, "PAIR_N": False, "PDL": False, "X_RING": False,
                  "MMA_ASYNC": False, "LIST": False, "num_warps": 4, "launch_pdl": False}
    assert k2 == {**k1, "FUSE_SILU": False, "OUT_PERMUTED": False, "UNROLL": 2}
    assert a2[3] is out and out.shape == (E, M, H) and out.dtype == torch.bfloat16
    assert a1[6:10] == (H, I, M, I // 128) and a2[6:10] == (I, H, M, 0)  # K, N_OUT, M_MAX, up_tiles
    assert a1[10:14] == (M * H, H, M * I, I)  # the slab's strides


def test_run_frag_runs_a_slab_as_a_block_list(monkeypatch):
    # a masked slab as a block list (the default where the layout bounds its rows): the programs are the block list
    # of its experts' token blocks, the blocks of experts with rows first, at the slab's strides (no row offsets);
    # the grid covers the whole slab unless the layout bounds its rows (max_rows): one token on 8 of 256 experts in
    # a 64-row slab launches 9 token blocks per N tile instead of 256 · 4
    from pdlab.moe.layouts import Masked
    from pdlab.moe.weights import ExpertWeights

    launches = _record_launches(monkeypatch)
    E, H, I, M = 3, 256, 128, 40
    w = ExpertWeights.from_bf16(torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, quantize=True)
    packs = F.pack_experts(w.w13_weight, w.w13_weight_scale, w.w2_weight, w.w2_weight_scale,
                           w.w13_weight_scale_2, w.w2_weight_scale_2)
    counts = torch.tensor([17, 0, 33], dtype=torch.int32)
    out = F.run_frag(Masked(torch.randn(E, M, H), counts), packs, I, torch.bfloat16, 16, slab_list=True)
    (g1, a1, k1), (g2, a2, k2) = launches
    assert g1 == (I // 128, E * 3) and g2 == (H // 128, E * 3)
    assert k1["LIST"] and k2["LIST"] and not k1["CONTIG"] and not k2["CONTIG"]
    assert a1[15] == a2[15] == E and F.block_schedule(counts, 16).tolist() == [0, 2, 2, 5]
    assert a1[10:14] == (M * H, H, M * I, I) and out.shape == (E, M, H)
    launches.clear()
    E2 = 256
    counts = torch.zeros(E2, dtype=torch.int32)
    counts[torch.arange(3, 256, 32)] = 1
    many = {k: v[:1].expand(E2, *v.shape[1:]) for k, v in packs.items()}
    F.run_frag(Masked(torch.randn(E2, 64, H), counts, max_rows=8), many, I, torch.bfloat16, 16)
    (g1, *_), (g2, *_) = launches
    assert g1 == (I // 128, 9) and g2 == (H // 128, 9) and F.max_blocks(8, E2, 16) == 9
    launches.clear()
    F.run_frag(Masked(torch.randn(E2, 64, H), counts), many, I, torch.bfloat16, 16, slab_list=True)
    (g1, a1, k1), _ = launches
    assert g1 == (I // 128, E2 * 4) and k1["LIST"]
    launches.clear()  # unbounded, automatic: one program per slab block (a list as long would search in each)
    F.run_frag(Masked(torch.randn(E2, 64, H), counts), many, I, torch.bfloat16, 16)
    (g1, a1, k1), _ = launches
    assert g1 == (I // 128, E2, 4) and not k1["LIST"]


def test_activation_pre_kernel_block_list_skips_empty_experts():
    # the slab's block list with experts without rows before, between and after those with rows: every valid row
    # converted as one program per slab row converts it, 2-row blocks (expert 1 owns blocks 0, 1; expert 3 2–4)
    from pdlab.moe.layouts import Masked

    dev = "cuda" if CUDA else "cpu"
    E, M, K = 5, 6, 256
    counts = torch.tensor([0, 3, 0, 5, 0], dtype=torch.int32, device=dev)
    x = Masked(torch.randn(E, M, K, device=dev).to(torch.bfloat16), counts)
    rows = F.prepare_activations(x.hidden, counts, block_m=0)
    listed = F.prepare_activations(x.hidden, counts, block_m=2, blocks=F.max_blocks(8, E, 2))
    keep = torch.arange(M, device=dev)[None, :] < counts[:, None]
    assert F.block_schedule(counts.cpu(), 2).tolist() == [0, 0, 2, 2, 5, 5]
    assert torch.equal(listed[keep], rows[keep])


def test_masked_max_rows_is_checked():
    from pdlab.moe.layouts import Masked

    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_rows"):
            Masked(torch.zeros(2, 3, 128), torch.zeros(2, dtype=torch.int32), max_rows=bad)
    assert Masked(torch.zeros(2, 3, 128), torch.zeros(2, dtype=torch.int32), max_rows=0).max_rows == 0


def test_run_frag_contiguous_block_list(monkeypatch):
    # contiguous rows: programs (N tile, token block of the block list); expert e owns ⌈counts[e] / BM⌉ blocks
    # from block_schedule(counts)[e] (each program finds its own from the counts); the grid covers every block
    # (⌈N / BM⌉ + min(E, N) is enough); rows addressed by offsets
    from pdlab.moe.layouts import Contiguous
    from pdlab.moe.weights import ExpertWeights

    launches = _record_launches(monkeypatch)
    E, H, I = 3, 256, 128
    w = ExpertWeights.from_bf16(torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, quantize=True)
    w.frag_()
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag

    packs = _repack_frag(w)
    assert packs["w13"] is w.w13_weight and packs["w2_s2"] is w.w2_weight_scale_2  # stored in place: no copy
    counts = torch.tensor([17, 0, 33], dtype=torch.int32)
    offsets = torch.tensor([0, 17, 17, 50], dtype=torch.int32)
    layout = Contiguous(torch.randn(50, H), counts, offsets)
    out = F.run_frag(layout, packs, I, torch.float32, 16)
    (g1, a1, k1), (g2, a2, k2) = launches
    starts = F.block_schedule(counts, 16)
    assert starts.tolist() == [0, 2, 2, 5]
    assert g1 == (I // 128, -(-50 // 16) + E) and g2 == (H // 128, -(-50 // 16) + E) and g1[1] >= int(starts[-1])
    assert a1[2].shape == (50, H) and a1[3].shape == (50, I) and out.shape == (50, H)
    assert a1[10:14] == (0, H, 0, I) and a2[10:14] == (0, I, 0, H)
    assert torch.equal(a1[14], offsets) and a1[15] == E
    assert k1["CONTIG"] and k2["CONTIG"]
    # few rows over many experts: the grid follows the rows (1 token × 8 of 256 experts: 9 blocks, not 257)
    launches.clear()
    E2 = 256
    counts = torch.zeros(E2, dtype=torch.int32)
    counts[torch.arange(3, 256, 32)] = 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0, dtype=torch.int32)])
    many = {k: v[:1].expand(E2, *v.shape[1:]) for k, v in packs.items()}  # one expert's tensors, 256 times
    F.run_frag(Contiguous(torch.randn(8, H), counts, offsets), many, I, torch.float32, 16)
    (g1, *_), (g2, *_) = launches
    assert g1[1] == g2[1] == 1 + 8 == F.max_blocks(8, E2, 16) >= int(F.block_schedule(counts, 16)[-1])


def test_block_bound_covers_every_block_list():
    # Σ ⌈c_e / BM⌉ ≤ ⌈N / BM⌉ + min(E, N) for any counts with Σ c_e ≤ N: random draws, and the extremes (all rows
    # to one expert, one row per expert, rows spread over every expert)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        E = int(torch.randint(1, 300, (1,), generator=g))
        N = int(torch.randint(0, 600, (1,), generator=g))
        bm = [16, 32, 64][int(torch.randint(0, 3, (1,), generator=g))]
        owner = torch.randint(0, E, (N,), generator=g)
        counts = torch.bincount(owner, minlength=E).to(torch.int32)
        assert int(F.block_schedule(counts, bm)[-1]) <= F.max_blocks(N, E, bm)
    for N, E, bm in [(1000, 1, 16), (256, 256, 16), (100, 256, 64), (0, 8, 16)]:
        counts = torch.bincount(torch.arange(N) % E, minlength=E).to(torch.int32)
        assert int(F.block_schedule(counts, bm)[-1]) <= F.max_blocks(N, E, bm)


def test_activation_pre_kernel_contiguous_rows():
    # contiguous rows: every row converted; an nvfp4 payload with one global scale per expert uses its row's
    from pdlab.moe.layouts import Contiguous, dequantize_hidden, quantize_payload

    dev = "cuda" if CUDA else "cpu"
    counts = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=dev)
    x = torch.randn(5, 256, device=dev) * 2
    gs = torch.tensor([0.5, 1.0, 2.0], device=dev)
    rows_gs = gs[torch.tensor([0, 0, 2, 2, 2], device=dev)]
    hidden, scales, _ = quantize_payload(x.to(torch.bfloat16), "nvfp4", torch.tensor([1.0], device=dev))
    y = F.prepare_activations(hidden, counts, "nvfp4", scales, gs, offsets)
    want = dequantize_hidden(Contiguous(hidden, counts, offsets, "nvfp4", scales, torch.tensor([1.0], device=dev)))
    want = (want.float() / rows_gs[:, None] * 2.0 ** -8).to(torch.float16)[:, F.column_order(256, dev)]
    assert torch.equal(y, want)


# ---------------------------------------------------------------------------------------------- H200


_NVFP4 = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2")


def _gpu_experts(E, H, I, generator=None):
    """Random NVFP4 experts on the GPU (skips where the fragment GEMMs cannot run)."""
    from pdlab.moe.weights import ExpertWeights

    if F.available(torch.device("cuda")) is not None:
        pytest.skip(F.available(torch.device("cuda")))
    return ExpertWeights.from_bf16(torch.randn(E, 2 * I, H, device="cuda", generator=generator) * 0.05,
                                   torch.randn(E, H, I, device="cuda", generator=generator) * 0.05, quantize=True)


def _modelopt_copy(w):
    """The same experts in the modelopt layout (a copy: `frag_` on one leaves the other as loaded)."""
    from pdlab.moe.weights import ExpertWeights

    return ExpertWeights.from_modelopt({k: getattr(w, k).clone() for k in _NVFP4})


@pytest.mark.gpu
@pytest.mark.parametrize("stored", ["copy", "in place"])
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("payload", ["bf16", "fp32", "fp8", "nvfp4"])
@pytest.mark.parametrize("E,H,I,M", [(4, 256, 128, 1), (3, 384, 256, 24), (2, 7168, 2048, 5), (2, 512, 256, 70)])
def test_gpu_frag_experts_match_the_reference(E, H, I, M, payload, layout, stored):
    from pdlab.bench.harness import cosine_error
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import Contiguous, Masked, quantize_payload
    from pdlab.moe.runners.triton_nvfp4 import frag_path_taken

    if stored == "in place" and (layout, payload) != ("contiguous", "nvfp4") and (E, M) != (2, 5):
        pytest.skip("experts stored in fragment order: one shape per layout and payload is enough")
    g = torch.Generator(device="cuda").manual_seed(E + M)
    w = _gpu_experts(E, H, I, g)
    ref_w = w
    if stored == "in place":
        ref_w = _modelopt_copy(w)
        w.frag_()
    counts = torch.tensor([max(0, M - 3 * e) for e in range(E)], dtype=torch.int32, device="cuda")
    x = torch.randn(E * M, H, device="cuda", generator=g)
    if payload in ("bf16", "fp32"):
        hidden, scales, gs = (x.to(torch.bfloat16) if payload == "bf16" else x), None, None
        payload = "bf16"
    else:
        hidden, scales, gs = quantize_payload(x.to(torch.bfloat16), payload,
                                              torch.tensor([0.3], device="cuda") if payload == "nvfp4" else None)
    hidden = hidden.view(E, M, -1).clone()
    if payload == "bf16":
        hidden[torch.arange(M, device="cuda")[None, :] >= counts[:, None]] = float("nan")  # never read
    slab = Masked(hidden, counts, payload, None if scales is None else scales.view(E, M, -1), gs)
    keep = torch.arange(M, device="cuda")[None, :] < counts[:, None]
    if layout == "contiguous":  # the valid rows, expert after expert, and two padding rows at the end
        pad = lambda t: torch.cat([t[keep], t[keep][:2]]) if t is not None else None  # noqa: E731
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
        rows = Contiguous(pad(slab.hidden), counts, offsets, payload, pad(slab.scales), gs)
    cfg = {"FRAG": 1}
    todo = slab if layout == "masked" else rows
    assert frag_path_taken(todo, w, cfg)
    out = run_experts(todo, w, runner="triton", config=cfg).hidden
    ref = run_experts(todo, ref_w, runner="torch", config={"weights": "nvfp4"}).hidden
    if layout == "masked":
        out, ref = out[keep], ref[keep]
    else:
        out, ref = out[:int(counts.sum())], ref[:int(counts.sum())]
    assert torch.isfinite(out).all()
    assert cosine_error(out.float(), ref.float()) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(block_m=16), dict(block_m=32, ring=2, ring_down=2, pair_down=True, pdl=True,
                                                         x_ring=True, mma_async=True),
                                   dict(block_m=64, ring=0, x_async_down=True, unroll_down=1)])
@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
def test_gpu_slab_block_list_equals_the_slab_grid(payload, knobs):
    # a masked slab run as a block list (the default; bounded by max_rows or not) writes the same bits as one
    # program per slab block, eagerly and in a CUDA graph; experts without rows sit between those with rows
    from pdlab.moe.layouts import Masked, quantize_payload
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag

    E, H, I, M = 12, 512, 256, 70
    g = torch.Generator(device="cuda").manual_seed(3)
    packs = _repack_frag(_gpu_experts(E, H, I, g))
    counts = torch.tensor([0, 70, 0, 0, 1, 33, 0, 16, 0, 0, 0, 5], dtype=torch.int32, device="cuda")
    x = torch.randn(E * M, H, device="cuda", generator=g).to(torch.bfloat16)
    hidden, scales, gs = quantize_payload(x, payload, torch.tensor([0.3], device="cuda") if payload == "nvfp4"
                                          else None)
    parts = (hidden.view(E, M, -1), counts, payload, None if scales is None else scales.view(E, M, -1), gs)
    keep = torch.arange(M, device="cuda")[None, :] < counts[:, None]
    grid = F.run_frag(Masked(*parts), packs, I, torch.bfloat16, slab_list=False, **knobs)[keep]
    for max_rows, listed in ((None, True), (int(counts.sum()), None), (4 * int(counts.sum()), None)):
        layout = Masked(*parts, max_rows=max_rows)
        assert torch.equal(F.run_frag(layout, packs, I, torch.bfloat16, slab_list=listed, **knobs)[keep], grid)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = F.run_frag(layout, packs, I, torch.bfloat16, slab_list=listed, **knobs)
        graph.replay()
        assert torch.equal(captured[keep], grid), max_rows


@pytest.mark.gpu
def test_gpu_frag_is_the_decode_default_and_graph_safe():
    from pdlab.bench.harness import cosine_error
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import Masked
    from pdlab.moe.runners.triton_nvfp4 import frag_path_taken

    E, H, I = 4, 512, 256
    w = _gpu_experts(E, H, I)
    x = torch.randn(E, 16, H, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([16, 3, 0, 9], dtype=torch.int32, device="cuda")
    layout = Masked(x, counts)
    assert frag_path_taken(layout, w, {})  # auto: a decode slab
    assert frag_path_taken(Masked(torch.randn(E, 80, H, device="cuda"), counts), w, {})  # any tokens per expert
    # experts stored tiled in place (the runtime's layout) are left to the in-loop kernel unless asked: the
    # fragment-order copy would double their memory
    tiled = _gpu_experts(E, H, I).tile_()
    assert not frag_path_taken(layout, tiled, {}) and frag_path_taken(layout, tiled, {"FRAG": 1})
    eager = run_experts(layout, w, runner="triton", config={}).hidden.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_experts(layout, w, runner="triton", config={}).hidden
    graph.replay()
    keep = torch.arange(16, device="cuda")[None, :] < counts[:, None]
    assert torch.equal(captured[keep], eager[keep])
    loop = run_experts(layout, w, runner="triton", config={"FRAG": 0}).hidden
    assert cosine_error(eager[keep].float(), loop[keep].float()) < 2e-5


@pytest.mark.gpu
def test_gpu_experts_stored_in_fragment_order():
    # the runtime's layout: no copy, the fragment GEMMs for decode slabs and contiguous rows alike (auto, any
    # tokens per expert), the dense prefill path dequantising from fragment order, and a CUDA graph captured
    # before any eager call (nothing to pack)
    from pdlab.bench.harness import cosine_error
    from pdlab.moe.experts import resolved_config, run_experts
    from pdlab.moe.layouts import Contiguous, Masked
    from pdlab.moe.runners.triton_nvfp4 import kernel_path

    E, H, I = 4, 512, 256
    plain = _gpu_experts(E, H, I)
    w = _modelopt_copy(plain).frag_()
    counts = torch.tensor([16, 3, 0, 9], dtype=torch.int32, device="cuda")
    slab = Masked(torch.randn(E, 16, H, device="cuda", dtype=torch.bfloat16), counts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_experts(slab, w, runner="triton", config={}).hidden
    graph.replay()
    eager = run_experts(slab, w, runner="triton", config={}).hidden
    keep = torch.arange(16, device="cuda")[None, :] < counts[:, None]
    assert torch.equal(captured[keep], eager[keep])
    assert "triton" not in w.prepared and "triton_tiled" not in w.prepared  # no copy in another layout
    ref = run_experts(slab, plain, runner="torch", config={"weights": "nvfp4"}).hidden
    assert cosine_error(eager[keep].float(), ref[keep].float()) < 2e-5
    big = torch.tensor([300, 0, 257, 40], dtype=torch.int32, device="cuda")
    offsets = torch.cat([big.new_zeros(1), torch.cumsum(big, 0, dtype=torch.int32)])
    rows = Contiguous(torch.randn(int(big.sum()), H, device="cuda", dtype=torch.bfloat16), big, offsets)
    for cfg, path in (({"DENSE_MIN_M": 0}, "fragment"), ({"DENSE_MIN_M": 64}, "dense")):
        assert kernel_path(rows, w, resolved_config(rows, w, "triton", cfg, 150)[0]) == path
        out = run_experts(rows, w, runner="triton", config=cfg, expected_m=150).hidden
        ref = run_experts(rows, plain, runner="torch", config={"weights": "nvfp4"}).hidden
        assert cosine_error(out.float(), ref.float()) < 2e-5, path
    assert "triton" not in w.prepared and "triton_tiled" not in w.prepared


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [2, 4, 16])
def test_gpu_dense_path_overlapped_dequantisation_is_bit_equal(chunk):
    # DENSE_OVERLAP: the next chunk's weights are dequantised on a side stream while the current chunk's GEMMs run
    # (two buffers, reused only after the GEMMs that read them); the result is the serial one bit for bit, with
    # empty experts (and a whole empty chunk) among them, and a large tensor of the main stream's freed right before
    from pdlab.bench.harness import cosine_error
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import Contiguous

    E, H, I = 8, 512, 256
    plain = _gpu_experts(E, H, I)
    w = _modelopt_copy(plain).frag_()
    counts = torch.tensor([300, 0, 0, 0, 257, 40, 0, 128], dtype=torch.int32, device="cuda")
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
    rows = Contiguous(torch.randn(int(counts.sum()), H, device="cuda", dtype=torch.bfloat16), counts, offsets)
    cfg = {"DENSE_MIN_M": 64, "DENSE_CHUNK": chunk}
    serial = run_experts(rows, w, runner="triton", config={**cfg, "DENSE_OVERLAP": 0}, expected_m=150).hidden
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # freed memory the scratch may be carved from
    del junk
    overlapped = run_experts(rows, w, runner="triton", config={**cfg, "DENSE_OVERLAP": 1}, expected_m=150).hidden
    torch.cuda.synchronize()
    assert torch.isfinite(overlapped).all() and torch.equal(serial, overlapped)
    ref = run_experts(rows, plain, runner="torch", config={"weights": "nvfp4"}).hidden
    assert cosine_error(overlapped.float(), ref.float()) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("bm,unroll", [(16, 2), (64, 1)])
def test_gpu_cp_async_activations_are_bit_equal(layout, bm, unroll):
    # FRAG_XASYNC: the activation tiles reach shared memory by cp.async instead of through registers; the MMAs see
    # the same operands, so the outputs are bit-equal
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import Contiguous, Masked

    E, H, I = 3, 768, 384  # K/128: gate_up 6 tiles; down 3 (odd: its two-tile loads fall back to one)
    w = _gpu_experts(E, H, I).frag_()
    counts = torch.tensor([20, 0, 7], dtype=torch.int32, device="cuda")
    if layout == "masked":
        x = Masked(torch.randn(E, 20, H, device="cuda", dtype=torch.bfloat16), counts)
    else:
        x = Contiguous(torch.randn(27, H, device="cuda", dtype=torch.bfloat16), counts,
                       torch.tensor([0, 20, 20, 27], dtype=torch.int32, device="cuda"))
    cfg = {"FRAG_BM": bm, "FRAG_UNROLL": unroll}
    a = run_experts(x, w, runner="triton", config={**cfg, "FRAG_XASYNC": 0}).hidden
    b = run_experts(x, w, runner="triton", config={**cfg, "FRAG_XASYNC": 1}).hidden  # the down GEMM's
    if layout == "masked":
        keep = torch.arange(20, device="cuda")[None, :] < counts[:, None]
        a, b = a[keep], b[keep]
    assert torch.isfinite(a).all() and torch.equal(a, b)
    # gate_up (SiLU fused, intermediate written in MMA order) with its activation tiles by cp.async too
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag

    packs = _repack_frag(w)
    off = None if layout == "masked" else x.offsets
    xp = F.prepare_activations(x.hidden, counts, offsets=off)
    h = [torch.zeros(xp.shape[:-1] + (I,), dtype=torch.float16, device="cuda") for _ in range(2)]
    for hh, xa in zip(h, (False, True)):
        F.frag_gemm(xp, packs["w13"], packs["w13_sf"], packs["w13_s2"], hh, counts, n_out=I, fuse_silu=True, block_m=bm,
                    offsets=off, x_async=xa)
    assert torch.equal(h[0], h[1]) and h[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("w_stages,maxnreg", [(2, None), (3, None), (4, None), (2, 128)])
def test_gpu_weight_ring_is_bit_equal(layout, bm, w_stages, maxnreg):
    # the weight tiles (and with x_ring the activation tiles) through the cp.async ring instead of registers: the MMAs
    # see the same operands, so both GEMMs' outputs are bit-equal to the register path's (K/128: gate_up 6 tiles,
    # down 3, fewer than some rings' slots)
    from pdlab.moe.layouts import Contiguous, Masked
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag

    E, H, I = 3, 768, 384
    w = _gpu_experts(E, H, I).frag_()
    packs = _repack_frag(w)
    counts = torch.tensor([20, 0, 7], dtype=torch.int32, device="cuda")
    rows = E * 20 if layout == "masked" else 27
    valid = (torch.arange(20, device="cuda")[None, :] < counts[:, None]).reshape(-1) if layout == "masked" \
        else slice(None)

    def as_layout(hidden):
        if layout == "masked":
            return Masked(hidden.view(E, 20, H), counts)
        return Contiguous(hidden, counts, torch.tensor([0, 20, 20, 27], dtype=torch.int32, device="cuda"))

    x = as_layout(torch.randn(rows, H, device="cuda").to(torch.bfloat16))
    off = None if layout == "masked" else x.offsets
    xp = F.prepare_activations(x.hidden, counts, offsets=off)
    # (weight ring slots, register cap, down GEMM's programs on two N tiles, activations through the ring,
    # asynchronous half-tile MMAs: the same products summed in the same K order, in two accumulators per tile)
    runs = [(0, None, False, False, False), (w_stages, maxnreg, False, False, False),
            (w_stages, maxnreg, True, False, False), (0, None, True, False, False),
            (w_stages, maxnreg, False, True, False), (w_stages, maxnreg, True, True, False),
            (w_stages, maxnreg, False, True, True), (w_stages, maxnreg, True, True, True)]
    h = [torch.zeros(xp.shape[:-1] + (I,), dtype=torch.float16, device="cuda") for _ in runs]
    y = [torch.zeros(xp.shape[:-1] + (H,), dtype=torch.bfloat16, device="cuda") for _ in runs]
    for hh, yy, (ws, reg, pair, xring, masync) in zip(h, y, runs):
        F.frag_gemm(xp, packs["w13"], packs["w13_sf"], packs["w13_s2"], hh, counts, n_out=I, fuse_silu=True,
                    block_m=bm, offsets=off, w_stages=ws, maxnreg=reg, x_ring=xring, mma_async=masync)
        F.frag_gemm(h[0], packs["w2"], packs["w2_sf"], packs["w2_s2"], yy, counts, n_out=H, fuse_silu=False,
                    block_m=bm, offsets=off, w_stages=ws, maxnreg=reg, pair_n=pair, x_ring=xring, mma_async=masync)
    flat = [t.reshape(rows, -1)[valid] for t in h + y]
    assert flat[0].float().abs().sum() > 0 and all(torch.isfinite(t).all() for t in flat)
    for i in range(1, len(runs)):
        assert torch.equal(flat[0], flat[i]) and torch.equal(flat[len(runs)], flat[len(runs) + i]), runs[i]
    # activations past fp16's range (±7e4; ·2^-8 fits): the plain GEMM x · W13ᵀ (bf16 out, no fp16 intermediate)
    # is finite and equals the fp32 reference on the dequantised weights
    big = torch.randn(rows, H, device="cuda")
    big[::5, 3::97] = 7e4
    xb = as_layout(big.to(torch.bfloat16))
    z = torch.zeros(xp.shape[:-1] + (2 * I,), dtype=torch.bfloat16, device="cuda")
    F.frag_gemm(F.prepare_activations(xb.hidden, counts, offsets=off), packs["w13"], packs["w13_sf"], packs["w13_s2"],
                z, counts, n_out=2 * I, fuse_silu=False, block_m=bm, offsets=off, w_stages=w_stages, maxnreg=maxnreg)
    from pdlab.bench.harness import cosine_error

    w13 = w.dequantized()[0]  # [E, 2I, H] fp32
    owner = [0] * 20 + [2] * 7 if layout == "contiguous" else [e for e in range(E) for _ in range(20)]
    want = torch.einsum("rk,rnk->rn", xb.hidden.reshape(rows, H).float(), w13[torch.tensor(owner)].float())
    z = z.reshape(rows, -1)[valid].float()
    assert z.abs().max() > 1e3 and torch.isfinite(z).all()
    assert cosine_error(z, want[valid]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("bm,payload", [(16, "bf16"), (16, "nvfp4"), (64, "bf16")])
@pytest.mark.parametrize("mma_async", [False, True])
def test_gpu_pdl_chain_is_bit_equal(layout, bm, payload, mma_async):
    # programmatic dependent launch: each GEMM starts while the kernel before it finishes and waits before it reads
    # that kernel's output. Replayed in a CUDA graph with new activations each time, the chain's output is bit-equal
    # to serial launches' on the same input: a GEMM that read its input before the wait would see the previous
    # replay's values (the graph's buffers stay put). One expert has no rows: its programs exit after their wait.
    # With mma_async, the GEMMs with rings issue their MMAs by half tiles (the shipped 16-token entries do both).
    from pdlab.moe.layouts import Contiguous, Masked, quantize_payload
    from pdlab.moe.runners.triton_nvfp4 import _repack_frag

    E, H, I, M = 4, 1024, 512, 24
    w = _gpu_experts(E, H, I).frag_()
    packs = _repack_frag(w)
    counts = torch.tensor([24, 0, 9, 17], dtype=torch.int32, device="cuda")
    rows = E * M if layout == "masked" else int(counts.sum())
    offsets = torch.tensor([0, 24, 24, 33, 50], dtype=torch.int32, device="cuda")
    hid = torch.zeros(rows, H, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(rows, H // 2, device="cuda", dtype=torch.uint8)
    sf = torch.zeros(rows, H // 16, device="cuda", dtype=torch.float8_e4m3fn)
    gs = torch.tensor([448.0 * 6.0 / 5.0], device="cuda")

    def as_layout():
        kw = {"payload": "nvfp4", "scales": sf, "global_scale": gs} if payload == "nvfp4" else {}
        data = q if payload == "nvfp4" else hid
        if layout == "masked":
            return Masked(data.view(E, M, -1), counts, **kw)
        return Contiguous(data, counts, offsets, **kw)

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        hid.copy_(torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16))
        if payload == "nvfp4":
            qq, ss, _ = quantize_payload(hid, "nvfp4", gs)
            q.copy_(qq)
            sf.copy_(ss.view(rows, -1))

    def run(pdl):  # (the activations through the rings where there are rings: the wait guards their copies too)
        return F.run_frag(as_layout(), packs, I, torch.bfloat16, bm, ring=2, ring_down=2 if bm == 16 else 0,
                          pair_down=bm == 16, x_async_down=bm == 64, pdl=pdl, x_ring=pdl,
                          mma_async=pdl and mma_async)

    fill(0)
    run(True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(True)
    valid = (torch.arange(M, device="cuda")[None, :] < counts[:, None]).reshape(-1) if layout == "masked" \
        else slice(None)
    for seed in range(1, 6):
        fill(seed)
        graph.replay()
        want = run(False)
        got, want = out.reshape(rows, H)[valid], want.reshape(rows, H)[valid]
        assert want.float().abs().sum() > 0 and torch.isfinite(want).all()
        assert torch.equal(got, want), f"replay {seed}: max |Δ| {(got.float() - want.float()).abs().max()}"
        assert torch.equal(run(True).reshape(rows, H)[valid], want)  # eager launches with PDL too


@pytest.mark.parametrize("m,H,cfg,want", [
    (64, 256, {}, (64, 1, True, 2, 2, True, False, True, False)),
    (16, 256, {}, (16, 2, False, 2, 2, True, False, True, True)),
    (16, 128, {}, (16, 2, False, 2, 0, False, False, True, True)),  # H % 256: no N-tile pairs
    (64, 128, {}, (64, 1, True, 2, 0, False, False, True, False)),
    (32, 256, {"FRAG_MMA_ASYNC": 0}, (32, 2, False, 2, 2, True, False, True, False)),
    (64, 256, {"FRAG_XASYNC": 0, "FRAG_PAIR_DOWN": 0, "FRAG_MMA_ASYNC": 1}, (64, 2, False, 2, 0, False, False, True,
                                                                            True)),
    (16, 256, {"FRAG_XASYNC": 1, "FRAG_UNROLL": 1, "FRAG_PAIR_DOWN": 0, "FRAG_RING": 0, "FRAG_PDL": 0,
               "FRAG_XRING": 0}, (16, 1, True, 0, 0, False, False, False, True)),
    (16, 256, {"FRAG_RING_DOWN": 3, "FRAG_PDL": 1}, (16, 2, False, 2, 3, True, True, True, True)),
    (1, 256, {}, (16, 2, False, 2, 2, True, False, True, False)),  # one token per expert: synchronous MMAs
    (1, 256, {"FRAG_MMA_ASYNC": 1}, (16, 2, False, 2, 2, True, False, True, True))])
def test_fragment_knobs_resolve_as_documented(monkeypatch, m, H, cfg, want):
    # defaults through the runner's config resolution: gate_up takes its weights through a two-slot cp.async ring;
    # the down GEMM pairs its N tiles (with its own two-slot ring) where H % 256 == 0; without pairs, 64-token
    # programs take the down GEMM's activations by cp.async with one tile in flight (measured faster); the GEMMs are
    # launched with programmatic dependent launch only with FRAG_PDL 1, and take their activations through their
    # rings unless FRAG_XRING is 0; 16- and 32-token programs expecting more than one token per expert issue their
    # MMAs asynchronously by half tiles unless FRAG_MMA_ASYNC is 0 (run_frag applies it to the GEMMs with a ring and
    # x_ring only)
    from pdlab.moe.layouts import Masked
    from pdlab.moe.runners import triton_nvfp4 as R
    from pdlab.moe.weights import ExpertWeights

    got = []
    monkeypatch.setattr(F, "run_frag", lambda layout, packs, inter, dtype, bm, unroll, x_async_down, **kw: got.append(
        (bm, unroll, x_async_down, kw["ring"], kw["ring_down"], kw["pair_down"], kw["pdl"], kw["x_ring"],
        kw["mma_async"])))
    w = ExpertWeights.from_bf16(torch.randn(2, 256, H) * 0.1, torch.randn(2, H, 128) * 0.1, quantize=True)
    layout = Masked(torch.randn(2, m, H), torch.tensor([m, 1], dtype=torch.int32))
    R._run_frag(layout, w, R.resolve_config({**R._DEFAULT, **cfg}, m), m)
    assert got == [want]
