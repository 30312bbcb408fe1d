"""The runtime stores NVFP4 experts in the Triton runner's tiled layout in place (one copy of the weights):
the served MoE layers compute what the plain layout computes. CPU: Triton interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.bench.harness import cosine_error  # noqa: E402
from pdlab.runtime.model import LoadOptions, load_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _moe_blocks(tile):
    opts = LoadOptions(attn_backend="torch", moe_runner="triton", moe_kwargs={"tile_weights": tile})
    model, _, cfg = load_model(None, DEV, torch.bfloat16, options=opts)
    return [layer.mlp for layer in model.model.layers if layer.is_moe], cfg


def test_tiled_experts_serve_the_same_outputs():
    plain, cfg = _moe_blocks(False)
    tiled, _ = _moe_blocks(True)
    assert all(b.moe.weights.nvfp4_tiled for b in tiled) and not any(b.moe.weights.nvfp4_tiled for b in plain)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(24, cfg.hidden_size, generator=g, device=DEV).to(torch.bfloat16)
    for p, t in zip(plain, tiled):
        a = p.moe.forward(x, mode="normal").float()
        b = t.moe.forward(x, mode="normal").float()
        assert torch.isfinite(b).all() and cosine_error(b, a) < 1e-5
        assert "triton" not in t.moe.weights.prepared  # no plain copy beside the tiled weights


def test_auto_tiling_only_for_triton_on_cuda():
    blocks, _ = _moe_blocks(None)
    expect = DEV == "cuda"
    assert all(b.moe.weights.nvfp4_tiled == expect for b in blocks)


@pytest.mark.parametrize("runner", ["torch"])
def test_no_tiling_for_other_runners(runner):
    opts = LoadOptions(attn_backend="torch", moe_runner=runner)
    model, _, _ = load_model(None, DEV, torch.float32, options=opts)
    assert not any(layer.mlp.moe.weights.nvfp4_tiled for layer in model.model.layers if layer.is_moe)
