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
    monkeypatch.setattr(triton_nvfp4, "_capturing", lambda: True)
    assert not dense_path_taken(layout, cfg, 4)
    _check(layout, weights, 1e-4 if not CUDA else 2e-4, config=cfg)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_gpu_fast_paths(kind, payload):
    layout, weights = _problem(8, 512, 256, 40, 4, payload, x_dtype=torch.bfloat16)
    _check(_as(kind, layout), weights, 2e-4, config=FAST)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"DEQ_ASM": 1, "PERM_K": 0}, {"DEQ_ASM": 0, "PERM_K": 1},
                                 dict(FAST, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
                                 dict(FAST, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                                 dict(FAST, SPLIT_NIBBLES=1)],
                         ids=["asm", "perm", "asm-perm-64x128", "asm-perm-128x128", "asm-split"])
def test_gpu_fast_path_configs(cfg):
    layout, weights = _problem(8, 512, 256, 200, 4, "bf16", x_dtype=torch.bfloat16)
    _check(_as("masked", layout), weights, 2e-4, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_gpu_fast_paths_deepseek_dims(kind):
    layout, weights = _problem(4, 7168, 2048, 24, 2, "bf16", x_dtype=torch.bfloat16)
    _check(_as(kind, layout), weights, 2e-4, config=FAST)


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
