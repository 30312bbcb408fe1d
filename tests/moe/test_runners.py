"""Expert runners × layouts × payloads against the torch fp32 reference.

CPU: the Triton runner runs under TRITON_INTERPRET=1 at tiny shapes (fp32/fp16 MMA). GPU (-m gpu):
the same checks at larger shapes in bf16, plus every tunable config family, DeepSeek-sized rows.
"""

import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.bench.harness import cosine_error
from pdlab.kernels.contracts import ShapeError
from pdlab.moe.experts import check_pairing, run_experts
from pdlab.moe.layouts import Contiguous, Masked, to_masked
from pdlab.moe.testing import random_experts_problem
from pdlab.moe.weights import ExpertWeights

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _problem(E, H, I, T, k, payload, device=DEV, skew=None, x_dtype=torch.float32, seed=0):
    return random_experts_problem(E, H, I, T, k, payload, device, skew, x_dtype, seed)


def _valid(out, layout):
    if isinstance(layout, Masked):
        keep = torch.arange(out.hidden.shape[1], device=out.hidden.device)[None, :] < layout.masked_m[:, None]
        return out.hidden[keep].float()
    return out.hidden[: layout.offsets[-1]].float()


def _check(layout, weights, runner, tol, config=None):
    ref = run_experts(layout, weights, runner="torch", config={"weights": "nvfp4" if weights.has_nvfp4 else "bf16"})
    out = run_experts(layout, weights, runner=runner, config=config)
    assert type(out) is type(layout) and out.payload == "bf16"
    a, b = _valid(out, layout), _valid(ref, layout)
    assert torch.isfinite(a).all()
    err = cosine_error(a, b)
    assert err < tol, f"{runner} cosine error {err}"
    return out


def _as(kind, layout, fill=float("nan")):
    return to_masked(layout, fill=fill) if kind == "masked" else layout


# ---------------------------------------------------------------------------------------------- CPU


TRITON_TOL = 1e-5 if not CUDA else 2e-4


@pytest.mark.parametrize("variant", [{}, {"SPLIT_NIBBLES": 1}, {"UNPACK16": 1}, {"PERM_K": 1}, {"PERM_K": 1, "DEQ_ASM": 1},
                                     {"SPLIT_NIBBLES": 1, "PERM_K": 1}],
                         ids=["interleave", "split", "i16", "perm", "asm", "split_perm"])
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_triton_matches_reference(kind, payload, variant):
    H = 128 if payload == "fp8" else 64
    layout, weights = _problem(4, H, 32, 9, 2, payload, x_dtype=torch.float32 if not CUDA else torch.bfloat16)
    _check(_as(kind, layout), weights, "triton", TRITON_TOL if payload == "bf16" else 1e-4, config=variant)


@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("skew", ["zero", "one"])
def test_triton_zero_token_experts_and_all_to_one(kind, skew):
    layout, weights = _problem(4, 64, 32, 7, 2, "nvfp4", skew=skew)
    counts = layout.counts.tolist()
    assert 0 in counts
    _check(_as(kind, layout), weights, "triton", 1e-4)


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_triton_fp16_mma_scales_activations(payload):
    # bf16 activations are not exact in the interpreter's bf16 dot: use fp32 inputs, large values
    # (beyond fp16's 65504) to prove the 2^-8 scaling keeps them in range
    layout, weights = _problem(3, 128, 32, 6, 2, payload, x_dtype=torch.float32)
    if payload == "bf16":  # |x| up to ~1e5 (> fp16 max), gate_up weights small so the intermediate stays sane
        layout = Contiguous(layout.hidden * 3e4, layout.counts, layout.offsets)
        assert layout.hidden.abs().max() > 65504
        w13, w2 = weights.dequantized()
        weights = ExpertWeights.from_bf16(w13 * 1e-3, w2)
    _check(layout, weights, "triton", 1e-4, config={"MMA_FP16": 1})


def test_triton_fp16_activations_and_split_k():
    layout, weights = _problem(3, 64, 64, 6, 2, "bf16", x_dtype=torch.float16)
    out = _check(layout, weights, "triton", 1e-4, config={"SPLIT_K": 2, "BLOCK_K": 32})
    assert out.hidden.dtype == torch.float16


@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_torch_grouped_matches_reference(kind):
    layout, _ = _problem(4, 64, 32, 9, 2, "bf16", x_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights.from_bf16((torch.randn(4, 64, 64, generator=g) / 8).bfloat16().to(DEV),
                                (torch.randn(4, 64, 32, generator=g) / 6).bfloat16().to(DEV), quantize=False)
    _check(_as(kind, layout, fill=0.0), w, "torch_grouped", 1e-4)


def test_masked_reference_ignores_rows_beyond_masked_m():
    layout, weights = _problem(4, 64, 32, 9, 2, "bf16")
    a = run_experts(to_masked(layout, fill=float("nan")), weights, runner="torch")
    assert torch.isfinite(_valid(a, a)).all()


def test_row_counts_beyond_the_slab_or_its_bound_are_named(monkeypatch):
    layout, weights = _problem(4, 64, 32, 9, 2, "bf16")
    masked = to_masked(layout)
    over = masked.masked_m.clone()
    over[int(over.argmax())] += 1  # one row more than the slab holds
    bad = Masked(masked.hidden, over, max_rows=None)
    # the reference reads the counts anyway: it always checks them
    with pytest.raises(ShapeError, match=r"moe_experts\[torch\] argument 'masked_m' counts rows the slab does not"):
        run_experts(bad, weights, runner="torch")
    # the other runners never sync the host for them, unless asked to (PDLAB_CHECK_INVARIANTS=1)
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    with pytest.raises(ShapeError, match=r"moe_experts\[torch_grouped\] argument 'masked_m'"):
        run_experts(bad, weights, runner="torch_grouped")
    short = Masked(masked.hidden, masked.masked_m, max_rows=masked.max_rows - 1)
    with pytest.raises(ShapeError, match="max_rows"):
        run_experts(short, weights, runner="torch_grouped")
    # a well-formed layout passes the check and runs (torch_grouped computes with the bf16 weights)
    out = run_experts(masked, weights, runner="torch_grouped")
    ref = run_experts(masked, weights, runner="torch", config={"weights": "bf16"})
    assert cosine_error(_valid(out, masked), _valid(ref, masked)) < 1e-4


def test_wrong_layout_raises_shape_error_with_hint():
    layout, weights = _problem(4, 64, 32, 9, 2, "nvfp4")
    # a masked-only runner handed the 2-D contiguous layout: ShapeError naming runner, argument and fix
    with pytest.raises(ShapeError) as exc:
        run_experts(layout, weights, runner="cutedsl")
    msg = str(exc.value)
    assert "moe_experts[cutedsl]" in msg and "'hidden'" in msg and "2 dims instead of 3" in msg
    assert "low-latency dispatch" in msg
    # a Masked object whose hidden is 2-D (the crash this op exists to prevent)
    bad = Masked(layout.hidden, layout.counts, "nvfp4", layout.scales, layout.global_scale)
    with pytest.raises(ShapeError, match="normal-mode dispatch"):
        run_experts(bad, weights, runner="torch")
    with pytest.raises(ShapeError, match="'layout'"):
        run_experts(layout.hidden, weights, runner="torch")


def test_weights_of_another_size_raise_shape_error():
    layout, _ = _problem(4, 64, 32, 9, 2, "bf16")
    _, other = _problem(4, 128, 32, 9, 2, "bf16")
    with pytest.raises(ShapeError, match="w13_weight"):
        run_experts(layout, other, runner="torch")


def test_check_pairing():
    check_pairing("masked", "nvfp4", "cutedsl")
    check_pairing("contiguous", "fp8", "triton")
    with pytest.raises(ValueError, match=r"'cutedsl'.*mode='low_latency'.*triton"):
        check_pairing("contiguous", "nvfp4", "cutedsl")
    with pytest.raises(ValueError, match=r"payload 'nvfp4'.*torch_grouped"):
        check_pairing("masked", "nvfp4", "torch_grouped")


# ------------------------------------------------------------------ cutedsl: argument translation


class _FakeFlashinfer:
    """Records the calls the cutedsl runner makes and computes them with the torch reference maths."""

    def __init__(self):
        self.calls = []

    def install(self, monkeypatch):
        fi = types.ModuleType("flashinfer")
        cute = types.ModuleType("flashinfer.cute_dsl")
        bs = types.ModuleType("flashinfer.cute_dsl.blockscaled_gemm")
        fi.scaled_fp4_grouped_quantize = self.quantize
        fi.silu_and_mul_scaled_nvfp4_experts_quantize = self.silu_quantize
        bs.grouped_gemm_nt_masked = self.gemm
        for name, mod in (("flashinfer", fi), ("flashinfer.cute_dsl", cute),
                          ("flashinfer.cute_dsl.blockscaled_gemm", bs)):
            monkeypatch.setitem(sys.modules, name, mod)

    def quantize(self, a, mask, global_sf):
        self.calls.append(("quantize", a.shape, a.dtype, mask, global_sf))
        return self._quantize(a, mask, global_sf)

    @staticmethod
    def _quantize(a, mask, global_sf):
        from pdlab.kernels.nvfp4 import quantize_nvfp4, swizzle_scales_128x4

        packed, sf = quantize_nvfp4(a, global_sf, masked_m=mask)
        return packed.permute(1, 2, 0), swizzle_scales_128x4(sf)

    def silu_quantize(self, a, mask, global_sf):
        i = a.shape[-1] // 2
        h = torch.nn.functional.silu(a[..., :i].float()) * a[..., i:].float()
        self.calls.append(("silu_quantize", a.shape, a.dtype, mask, global_sf))
        return self._quantize(h, mask, global_sf)

    def gemm(self, a_pair, b_pair, out, masked_m, *, ab_dtype, sf_dtype, c_dtype, sf_vec_size, alpha,
             alpha_dtype):
        from pdlab.kernels.nvfp4 import dequantize_nvfp4, unswizzle_scales_128x4

        (a, sfa), (b, sfb) = a_pair, b_pair
        self.calls.append(("gemm", a.shape, b.shape, out.shape, ab_dtype, sf_dtype, c_dtype, sf_vec_size,
                           alpha.shape, alpha_dtype))
        m, k2, l = a.shape
        n = b.shape[0]
        assert b.shape[1:] == (k2, l) and out.shape == (m, n, l), "logical [m, k, l] views expected"
        A = dequantize_nvfp4(a.permute(2, 0, 1), unswizzle_scales_128x4(sfa, m, k2 // 8), 1.0)
        B = dequantize_nvfp4(b.permute(2, 0, 1), unswizzle_scales_128x4(sfb, n, k2 // 8), 1.0)
        res = torch.einsum("lmk,lnk->lmn", A, B) * alpha.view(l, 1, 1)
        out.copy_(res.permute(1, 2, 0).to(out.dtype))


@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
def test_cutedsl_argument_translation(monkeypatch, payload):
    from pdlab.kernels import registry
    from pdlab.moe.runners import cutedsl

    fake = _FakeFlashinfer()
    fake.install(monkeypatch)
    layout, weights = _problem(4, 64, 32, 9, 2, payload, device="cpu")
    masked = to_masked(layout, fill=float("nan") if payload == "bf16" else None)
    out = registry.get_backend("moe_experts", "cutedsl").impl(masked, weights, config={})
    kinds = [c[0] for c in fake.calls]
    assert kinds == (["quantize"] if payload == "bf16" else []) + ["gemm", "silu_quantize", "gemm"]
    g1 = fake.calls[kinds.index("gemm")]
    assert g1[4:8] == ("float4_e2m1fn", "float8_e4m3fn", "bfloat16", 16) and g1[8] == (1, 1, 4)
    p = weights.prepared["cutedsl"]
    torch.testing.assert_close(p["alpha2"], weights.w2_input_scale * weights.w2_weight_scale_2)
    assert p["w13_sf"].shape == (4, 1, 1, 32, 4, 4)  # 2I=64 rows → one 128-row tile, H/16=4 → one k tile
    # numerics: the chain (NVFP4 activations both GEMMs) is close to the fp32 reference
    ref = run_experts(masked, weights, runner="torch")
    keep = torch.arange(masked.hidden.shape[1])[None, :] < masked.masked_m[:, None]
    assert cosine_error(out[keep].float(), ref.hidden[keep].float()) < 5e-2
    # weights are repacked once
    before = p["w13_sf"]
    registry.get_backend("moe_experts", "cutedsl").impl(masked, weights, config={})
    assert weights.prepared["cutedsl"]["w13_sf"] is before
    assert cutedsl._probe() is None


def test_cutedsl_missing_module_is_reported(monkeypatch):
    from pdlab.moe.runners import cutedsl

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    for m in ("flashinfer.cute_dsl", "flashinfer.cute_dsl.blockscaled_gemm", "flashinfer.gemm",
              "flashinfer.fp4_quantization", "flashinfer.quantization", "flashinfer.activation"):
        monkeypatch.setitem(sys.modules, m, None)
    assert "grouped_gemm_nt_masked" in cutedsl._probe()


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("tokens", [5, 300])
def test_gpu_triton_bf16_numerics(kind, payload, tokens):
    layout, weights = _problem(8, 512, 256, tokens, 4, payload, x_dtype=torch.bfloat16, seed=tokens)
    _check(_as(kind, layout), weights, "triton", 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("payload", ["fp8", "nvfp4"])
@pytest.mark.parametrize("variant", [{"SPLIT_NIBBLES": 1}, {"UNPACK16": 1}, {"MMA_FP16": 1}], ids=["split", "i16", "fp16"])
def test_gpu_triton_variants_quantized_payloads(payload, variant):
    layout, weights = _problem(8, 512, 256, 40, 4, payload, x_dtype=torch.bfloat16)
    _check(_as("masked", layout), weights, "triton", 2e-4, config=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=512, num_warps=8, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2, GROUP_M=1),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, SPLIT_K=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=16),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, SPLIT_NIBBLES=1),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT_NIBBLES=1),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=5, MMA_FP16=1),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, MMA_FP16=1),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, UNPACK16=1, MMA_FP16=1),
], ids=lambda c: "-".join(f"{k[0]}{k[-1]}{v}" for k, v in c.items()))
def test_gpu_triton_configs(cfg):
    layout, weights = _problem(8, 512, 256, 200, 4, "bf16", x_dtype=torch.bfloat16)
    _check(_as("masked", layout), weights, "triton", 2e-4, config=cfg)
    _check(layout, weights, "triton", 2e-4, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_gpu_triton_deepseek_dims(kind):
    layout, weights = _problem(4, 7168, 2048, 24, 2, "bf16", x_dtype=torch.bfloat16)
    _check(_as(kind, layout), weights, "triton", 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_gpu_torch_grouped(kind):
    layout, weights = _problem(8, 512, 256, 100, 4, "bf16", x_dtype=torch.bfloat16)
    w = ExpertWeights.from_bf16(weights.w13.bfloat16(), weights.w2.bfloat16(), quantize=False)
    _check(_as(kind, layout, fill=0.0), w, "torch_grouped", 2e-4)


@pytest.mark.gpu
def test_gpu_triton_cuda_graph_capture():
    layout, weights = _problem(8, 512, 256, 40, 2, "nvfp4", x_dtype=torch.bfloat16)
    masked = to_masked(layout)
    ref = run_experts(masked, weights, runner="triton").hidden.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_experts(masked, weights, runner="triton")
    g.replay()
    torch.cuda.synchronize()
    keep = torch.arange(masked.hidden.shape[1], device=DEV)[None, :] < masked.masked_m[:, None]
    assert torch.equal(out.hidden[keep], ref[keep])
