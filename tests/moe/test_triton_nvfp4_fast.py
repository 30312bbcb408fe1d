"""The triton runner's fast paths: PTX nibble unpack (DEQ_ASM), permuted K (PERM_K), and the dense
prefill path (NVFP4 → bf16 once per chunk of experts, then torch._grouped_mm), against the torch
fp32 reference. CPU: interpreter (DEQ_ASM falls back to the integer unpack); GPU (-m gpu): the PTX
path itself, DeepSeek dims."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.bench.harness import cosine_error  # noqa: E402
from pdlab.kernels import nvfp4  # noqa: E402
from pdlab.moe.experts import run_experts  # noqa: E402
from pdlab.moe.layouts import Masked, to_masked  # noqa: E402
from pdlab.moe.runners.triton_nvfp4 import dense_path_taken  # noqa: E402
from pdlab.moe.triton.nvfp4_dequant import nvfp4_to_bf16  # noqa: E402
from pdlab.moe.testing import random_experts_problem  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FAST = {"DEQ_ASM": 1, "PERM_K": 1}


def _problem(E, H, I, T, k, payload, skew=None, x_dtype=torch.float32, seed=0):
    return random_experts_problem(E, H, I, T, k, payload, DEV, skew, x_dtype, seed)


def _as(kind, layout):
    return to_masked(layout, fill=float("nan")) if kind == "masked" else layout


def _check(layout, weights, tol, config):
    ref = run_experts(layout, weights, runner="torch", config={"weights": "nvfp4"})
    out = run_experts(layout, weights, runner="triton", config=config)
    if isinstance(layout, Masked):
        keep = torch.arange(layout.hidden.shape[1], device=DEV)[None, :] < layout.masked_m[:, None]
        a, b = out.hidden[keep].float(), ref.hidden[keep].float()
    else:
        a, b = out.hidden[: layout.offsets[-1]].float(), ref.hidden[: layout.offsets[-1]].float()
    assert torch.isfinite(a).all()
    err = cosine_error(a, b)
    assert err < tol, f"triton {config} cosine error {err}"


def _dequant_case(E, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    sf = (0.01 + 400 * torch.rand(E, N, K // 16, generator=g)).to(torch.float8_e4m3fn)
    s2 = 0.001 + torch.rand(E, generator=g) / 100
    return w.to(DEV), sf.to(DEV), s2.to(DEV)


@pytest.mark.parametrize("K", [32, 256, 1024])
def test_nvfp4_to_bf16_matches_reference(K):
    w, sf, s2 = _dequant_case(3, 48, K)
    ref = nvfp4.dequantize_nvfp4(w, sf, 1.0 / s2, torch.float32)
    out = nvfp4_to_bf16(w, sf.view(torch.uint8), s2)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    if CUDA:  # same arithmetic, one rtne rounding
        assert torch.equal(out, ref.to(torch.bfloat16))
    else:  # the interpreter's fp32 → bf16 cast truncates: within one bf16 ulp
        assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("skew", [None, "zero", "one"])
def test_dense_path_matches_reference(skew):
    layout, weights = _problem(5, 64, 32, 12, 2, "bf16", skew=skew, x_dtype=torch.bfloat16)
    cfg = {"DENSE_MIN_M": 1, "DENSE_CHUNK": 2}
    assert dense_path_taken(layout, cfg, 4)
    # bf16 weights and bf16 GEMMs: the torch_grouped runner's arithmetic and CPU tolerance (1e-4)
    _check(layout, weights, 1e-4 if not CUDA else 2e-4, config=cfg)


def test_dense_path_only_for_contiguous_bf16():
    layout, weights = _problem(4, 64, 32, 9, 2, "bf16")
    cfg = {"DENSE_MIN_M": 1}
    assert not dense_path_taken(_as("masked", layout), cfg, 4)
    assert not dense_path_taken(layout, {"DENSE_MIN_M": 0}, 4096)
    assert not dense_path_taken(layout, {"DENSE_MIN_M": 512}, 256)
    nv, _ = _problem(4, 64, 32, 9, 2, "nvfp4")
    assert not dense_path_taken(nv, cfg, 4)


def test_dense_path_steps_aside_while_a_cuda_graph_is_captured(monkeypatch):
    # its host read of the offsets cannot be captured: the in-loop kernel runs instead, same results
    from pdlab.moe.runners import triton_nvfp4

    layout, weights = _problem(4, 64, 32, 9, 2, "bf16", x_dtype=torch.bfloat16)
    cfg = {"DENSE_MIN_M": 1}
    assert dense_path_taken(layout, cfg, 4)
    monkeypatch.setattr(triton_nvfp4, "capturing", lambda: True)
    assert not dense_path_taken(layout, cfg, 4)
    _check(layout, weights, 1e-4 if not CUDA else 2e-4, config=cfg)


def test_tile_nvfp4_known_layout():
    # element (n, byte j) of expert e lands at row-group n//16, chunk j//64, row n%16, byte j%64
    from pdlab.moe.weights import tile_nvfp4

    E, N, KH = 2, 32, 128
    w = torch.arange(E * N * KH, dtype=torch.int64).remainder(251).to(torch.uint8).view(E, N, KH)
    sf = torch.arange(E * N * KH // 8, dtype=torch.int64).remainder(241).to(torch.uint8).view(E, N, KH // 8)
    wt, st = tile_nvfp4(w, sf)
    flat_w, flat_s = wt.reshape(E, -1), st.reshape(E, -1)
    for e, n, j in [(0, 0, 0), (1, 17, 70), (0, 31, 127), (1, 5, 64)]:
        assert flat_w[e, (n // 16) * 16 * KH + (j // 64) * 1024 + (n % 16) * 64 + j % 64] == w[e, n, j]
        js = j // 8
        assert flat_s[e, (n // 16) * 16 * (KH // 8) + (js // 8) * 128 + (n % 16) * 8 + js % 8] == sf[e, n, js]
    with pytest.raises(ValueError, match="N % 16 == 0"):
        tile_nvfp4(w[:, :24], sf[:, :24])


@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("payload,extra", [("bf16", {}), ("nvfp4", {}), ("fp8", {}), ("bf16", {"SPLIT_NIBBLES": 1}),
                                           ("bf16", {"SPLIT_K": 2, "BLOCK_K": 128})],
                         ids=["bf16", "nvfp4", "fp8", "bf16-split-nibbles", "bf16-split-k"])
def test_tiled_weights_give_the_plain_layouts_result(kind, payload, extra):
    # same tiles, same arithmetic, other addresses: equal to the plain layout's output, and to the reference
    # (the in-loop kernel: on sm90 FRAG's automatic choice would run plain weights through the fragment GEMMs)
    layout, weights = _problem(3, 256, 256, 10, 2, payload, x_dtype=torch.bfloat16)
    layout = _as(kind, layout)
    cfg = {"FRAG": 0, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1,
           **extra}
    plain = run_experts(layout, weights, runner="triton", config={**cfg, "TILED": 0}).hidden
    tiled = run_experts(layout, weights, runner="triton", config={**cfg, "TILED": 1}).hidden
    assert "triton_tiled" in weights.prepared
    if isinstance(layout, Masked):
        keep = torch.arange(layout.hidden.shape[1], device=DEV)[None, :] < layout.masked_m[:, None]
        plain, tiled = plain[keep], tiled[keep]
    assert torch.equal(plain, tiled)
    _check(layout, weights, 2e-4, config={**cfg, "TILED": 1})


@pytest.mark.parametrize("payload,extra", [("bf16", {}), ("nvfp4", {"TILED": 1}), ("bf16", {"SPLIT_K": 2})],
                         ids=["bf16", "nvfp4-tiled", "bf16-split-k"])
def test_in_loop_kernel_runs_a_bounded_slab_as_a_block_list(monkeypatch, payload, extra):
    # a slab whose producer bounds its rows (max_rows) runs as the block list of its experts' token blocks: the
    # programs per N tile are max_blocks(max_rows), not E · ⌈M / BLOCK_M⌉, and every valid row gets the bits one
    # program per (expert, slab block) gives it (experts 0, 2, 4, 5 without rows, before, between and after)
    from dataclasses import replace

    from pdlab.moe.triton import nvfp4_moe as M

    grids = []
    kernel = M._moe_nvfp4_gemm

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(M, "_moe_nvfp4_gemm", Spy())
    layout, weights = _problem(6, 256, 256, 40, 1, payload, skew="zero", x_dtype=torch.bfloat16)
    masked = _as("masked", layout)
    rows, slab = int(masked.masked_m.sum()), masked.hidden.shape[1]
    assert masked.max_rows == rows == 40 and slab > 16
    cfg = {"FRAG": 0, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, **extra}
    keep = torch.arange(slab, device=DEV)[None, :] < masked.masked_m[:, None]
    grid = run_experts(replace(masked, max_rows=None), weights, runner="triton", config=cfg).hidden[keep]
    assert [g[0] // (256 // 32) for g in grids[-1:]] == [6 * -(-slab // 16)]
    for bound in (rows, 4 * rows):
        grids.clear()
        out = run_experts(replace(masked, max_rows=bound), weights, runner="triton", config=cfg).hidden
        assert torch.equal(out[keep], grid), bound
        assert grids[-1][0] // (256 // 32) == min(6 * -(-slab // 16), M.max_blocks(bound, 6, 16))
    _check(masked, weights, 2e-4, config=cfg)


def test_tiled_is_ignored_where_it_does_not_fit():
    # I = 96 is not a multiple of 128: the plain layout runs, no tiled copy is made
    layout, weights = _problem(2, 128, 96, 6, 1, "bf16", x_dtype=torch.bfloat16)
    _check(layout, weights, 2e-4, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "TILED": 1})
    assert "triton_tiled" not in weights.prepared


def test_untile_inverts_tile():
    from pdlab.moe.weights import tile_nvfp4, untile_nvfp4

    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (3, 48, 192), dtype=torch.uint8, generator=g)
    sf = torch.randint(0, 256, (3, 48, 24), dtype=torch.uint8, generator=g)
    back_w, back_sf = untile_nvfp4(*tile_nvfp4(w, sf))
    assert torch.equal(back_w, w) and torch.equal(back_sf, sf)


def _tiled_copy(weights):
    """An independent copy of `weights` stored tiled in place (the original stays plain)."""
    from pdlab.moe.layer import slice_experts

    copy = slice_experts(weights, 0, weights.num_experts)  # views: tile_ must copy, not tile the original
    return copy.tile_()


def test_tile_in_place_keeps_values_and_leaves_viewed_tensors_alone():
    layout, weights = _problem(3, 256, 128, 10, 2, "bf16", x_dtype=torch.bfloat16)
    before = {k: getattr(weights, k).clone() for k in ("w13_weight", "w13_weight_scale", "w2_weight")}
    tiled = _tiled_copy(weights)
    assert tiled.nvfp4_tiled and not weights.nvfp4_tiled
    for k, v in before.items():  # the sliced-from tensors were not tiled under their owner
        assert torch.equal(getattr(weights, k).view(torch.uint8), v.view(torch.uint8))
    assert not torch.equal(tiled.w13_weight, weights.w13_weight)  # stored tiled
    plain = tiled.plain_nvfp4()
    assert torch.equal(plain["w13_weight"], weights.w13_weight)
    assert torch.equal(plain["w2_weight_scale"].view(torch.uint8), weights.w2_weight_scale.view(torch.uint8))
    a, b = tiled.dequantized(), weights.dequantized()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert tiled.tile_() is tiled  # idempotent
    with pytest.raises(ValueError, match="multiples of 128"):
        _problem(2, 128, 96, 4, 1, "bf16")[1].tile_()


@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_runner_reads_weights_stored_tiled_without_a_plain_copy(kind):
    # decode (TILED by heuristic) and an in-loop prefill config with BLOCK_K 64 (raised to 128 for tiled
    # weights): equal to the plain weights' results, and no plain repack is ever built
    layout, weights = _problem(3, 256, 256, 30, 2, "bf16", x_dtype=torch.bfloat16)
    layout = _as(kind, layout)
    tiled = _tiled_copy(weights)
    for cfg in ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 1},
                {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 1, "SPLIT_K": 2}):
        ref = run_experts(layout, weights, runner="triton", config={**cfg, "TILED": 0}).hidden
        out = run_experts(layout, tiled, runner="triton", config=cfg).hidden
        if isinstance(layout, Masked):
            keep = torch.arange(layout.hidden.shape[1], device=DEV)[None, :] < layout.masked_m[:, None]
            ref, out = ref[keep], out[keep]
        assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
        assert cosine_error(out.float(), ref.float()) < 1e-5
    assert "triton" not in tiled.prepared
    # the torch reference reads the plain layout through plain_nvfp4()
    _check(layout, tiled, 2e-4, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 1})


def test_dense_path_reads_weights_stored_tiled():
    layout, weights = _problem(5, 256, 128, 12, 2, "bf16", x_dtype=torch.bfloat16)
    tiled = _tiled_copy(weights)
    cfg = {"DENSE_MIN_M": 1, "DENSE_CHUNK": 2}
    assert dense_path_taken(layout, cfg, 4)
    ref = run_experts(layout, weights, runner="triton", config=cfg).hidden
    out = run_experts(layout, tiled, runner="triton", config=cfg).hidden
    assert torch.equal(out, ref)
    assert "triton" not in tiled.prepared


@pytest.mark.parametrize("K", [128, 1024])
def test_nvfp4_to_bf16_reads_the_tiled_layout(K):
    from pdlab.moe.weights import tile_nvfp4

    w, sf, s2 = _dequant_case(3, 48, K)
    plain = nvfp4_to_bf16(w, sf.view(torch.uint8), s2)
    wt, st = tile_nvfp4(w, sf.view(torch.uint8))
    assert torch.equal(nvfp4_to_bf16(wt, st, s2, tiled=True), plain)
    with pytest.raises(ValueError, match="tiled weights need"):
        nvfp4_to_bf16(w[:, :40], sf.view(torch.uint8)[:, :40], s2, tiled=True)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1], ids=["interleave", "split"])
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_gpu_fast_paths(kind, payload, split):
    layout, weights = _problem(8, 512, 256, 40, 4, payload, x_dtype=torch.bfloat16)
    _check(_as(kind, layout), weights, 2e-4, config=dict(FAST, SPLIT_NIBBLES=split))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"DEQ_ASM": 1, "PERM_K": 0}, {"DEQ_ASM": 0, "PERM_K": 1},
                                 dict(FAST, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
                                 dict(FAST, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                                 dict(FAST, SPLIT_NIBBLES=1), dict(FAST, TILED=1),
                                 dict(FAST, TILED=1, BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2),
                                 dict(FAST, DEQ_ASM=2, TILED=1), dict(FAST, DEQ_ASM=2, SPLIT_NIBBLES=1),
                                 {"DEQ_ASM": 2, "PERM_K": 0}, dict(FAST, SPLIT_NIBBLES=1, TILED=1),
                                 dict(FAST, SPLIT_NIBBLES=1, TILED=1, BLOCK_N=64, num_stages=4),
                                 {"DEQ_ASM": 1, "PERM_K": 0, "SPLIT_NIBBLES": 1}],
                         ids=["asm", "perm", "asm-perm-64x128", "asm-perm-128x128", "asm-split", "tiled",
                              "tiled-64x64x256", "prmt-tiled", "prmt-split", "prmt-noperm", "split-tiled",
                              "split-tiled-n64", "split-noperm"])
def test_gpu_fast_path_configs(cfg):
    layout, weights = _problem(8, 512, 256, 200, 4, "bf16", x_dtype=torch.bfloat16)
    _check(_as("masked", layout), weights, 2e-4, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("tiled", [0, 1])
@pytest.mark.parametrize("split", [0, 1], ids=["interleave", "split"])
def test_gpu_fast_paths_deepseek_dims(kind, tiled, split):
    layout, weights = _problem(4, 7168, 2048, 24, 2, "bf16", x_dtype=torch.bfloat16)
    _check(_as(kind, layout), weights, 2e-4, config=dict(FAST, TILED=tiled, SPLIT_NIBBLES=split))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1])
def test_gpu_prmt_unpack_equals_the_integer_unpack_bit_for_bit(split):
    # DEQ_ASM=2 (byte permutes, no conversion instruction) builds the integer unpack's fp16 bits and scales
    # them with the same fp16 multiply: the experts' outputs must be identical, not just close
    layout, weights = _problem(8, 512, 256, 120, 4, "bf16", x_dtype=torch.bfloat16)
    masked = to_masked(layout)
    cfg = dict(TILED=1, MMA_FP16=1, SPLIT_NIBBLES=split)
    prmt = run_experts(masked, weights, runner="triton", config=dict(cfg, DEQ_ASM=2, PERM_K=1)).hidden
    ints = run_experts(masked, weights, runner="triton", config=dict(cfg, DEQ_ASM=0, PERM_K=1)).hidden
    keep = torch.arange(masked.hidden.shape[1], device=DEV)[None, :] < masked.masked_m[:, None]
    assert torch.equal(prmt[keep], ints[keep])


@pytest.mark.gpu
def test_gpu_dense_path_deepseek_dims():
    layout, weights = _problem(4, 7168, 2048, 600, 2, "bf16", x_dtype=torch.bfloat16)
    cfg = {"DENSE_MIN_M": 1, "DENSE_CHUNK": 3}
    assert dense_path_taken(layout, cfg, 300)
    _check(layout, weights, 2e-4, config=cfg)


@pytest.mark.gpu
def test_gpu_fast_path_cuda_graph_capture():
    layout, weights = _problem(8, 512, 256, 40, 2, "bf16", x_dtype=torch.bfloat16)
    masked = to_masked(layout)
    ref = run_experts(masked, weights, runner="triton", config=FAST).hidden.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_experts(masked, weights, runner="triton", config=FAST)
    g.replay()
    torch.cuda.synchronize()
    keep = torch.arange(masked.hidden.shape[1], device=DEV)[None, :] < masked.masked_m[:, None]
    assert torch.equal(out.hidden[keep], ref[keep])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,cfg", [(24, FAST), (600, {"DENSE_MIN_M": 1, "DENSE_CHUNK": 3})],
                         ids=["decode", "dense"])
def test_gpu_weights_stored_tiled_deepseek_dims(tokens, cfg):
    # what the runtime serves on CUDA: ExpertWeights.tile_() in place, in-loop decode and the dense path
    layout, weights = _problem(4, 7168, 2048, tokens, 2, "bf16", x_dtype=torch.bfloat16)
    tiled = _tiled_copy(weights)
    ref = run_experts(layout, weights, runner="triton", config=cfg).hidden
    out = run_experts(layout, tiled, runner="triton", config=cfg).hidden
    n = int(layout.offsets[-1])
    assert cosine_error(out[:n].float(), ref[:n].float()) < 1e-5
    _check(layout, tiled, 2e-4, config=cfg)
