"""The runtime stores NVFP4 experts in the Triton runner's layout in place (one copy of the weights): fragment
order where its Gluon GEMMs run (sm90), else tiled; the served MoE layers compute what the layout as loaded
computes. CPU: Triton interpreter (the fragment-order store is checked there through the runner's fallback)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.bench.harness import cosine_error  # noqa: E402
from pdlab.moe.triton.nvfp4_frag import available  # noqa: E402
from pdlab.runtime.model import LoadOptions, load_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _moe_blocks(layout):
    opts = LoadOptions(attn_backend="torch", moe_runner="triton", moe_kwargs={"weights_layout": layout})
    model, _, cfg = load_model(None, DEV, torch.bfloat16, options=opts)
    return [layer.mlp for layer in model.model.layers if layer.is_moe], cfg


@pytest.mark.parametrize("layout", ["tiled", "fragment"])
def test_stored_layouts_serve_the_same_outputs(layout):
    plain, cfg = _moe_blocks("modelopt")
    stored, _ = _moe_blocks(layout)
    assert all(b.moe.weights.nvfp4_layout == layout for b in stored)
    assert not any(b.moe.weights.nvfp4_layout != "modelopt" for b in plain)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(24, cfg.hidden_size, generator=g, device=DEV).to(torch.bfloat16)
    for p, t in zip(plain, stored):
        a = p.moe.forward(x, mode="normal").float()
        b = t.moe.forward(x, mode="normal").float()
        assert torch.isfinite(b).all() and cosine_error(b, a) < 1e-5
        if layout == "tiled" or available(torch.device(DEV)) is None:
            assert "triton" not in t.moe.weights.prepared  # no copy in the modelopt layout beside the stored one


def test_auto_layout_only_for_triton_on_cuda():
    blocks, _ = _moe_blocks(None)
    expect = "modelopt" if DEV != "cuda" else "fragment" if available(torch.device(DEV)) is None else "tiled"
    assert all(b.moe.weights.nvfp4_layout == expect for b in blocks)


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="weights_layout 'frag'"):
        _moe_blocks("frag")


@pytest.mark.parametrize("runner", ["torch"])
def test_no_relayout_for_other_runners(runner):
    opts = LoadOptions(attn_backend="torch", moe_runner=runner)
    model, _, _ = load_model(None, DEV, torch.float32, options=opts)
    assert not any(layer.mlp.moe.weights.nvfp4_layout != "modelopt" for layer in model.model.layers if layer.is_moe)


def test_server_flag_reaches_the_moe_layers():
    # `runtime serve --moe-weights-layout tiled`: the engine stores every MoE layer's experts so, and says so
    from pdlab.runtime.config import ServerConfig
    from pdlab.runtime.engine.engine import Engine

    cfg = ServerConfig(device=DEV, moe_weights_layout="tiled", disable_cuda_graph=True, max_total_tokens=1024,
                       max_context_len=512)
    engine = Engine(cfg)
    layers = [m for m in engine.model.modules() if getattr(m, "moe", None) is not None and hasattr(m.moe, "weights")]
    assert layers and all(m.moe.weights.nvfp4_layout == "tiled" for m in layers)
    assert any("NVFP4 weights tiled" in line for line in engine.describe())
    with pytest.raises(Exception, match="moe_weights_layout"):
        ServerConfig(moe_weights_layout="frag")


def test_disaggregated_roles_take_the_flag_too():
    # a prefill / decode server built by the disaggregation launcher stores its experts as asked
    from pdlab.runtime.disagg.config import RoleConfig
    from pdlab.runtime.disagg.launch import _load

    for role in ("prefill", "decode"):
        cfg = RoleConfig(role=role, device=DEV, moe_weights_layout="tiled", disable_cuda_graph=True)
        model = _load(cfg, None, None)[0]
        layers = [m for m in model.modules() if getattr(m, "moe", None) is not None and hasattr(m.moe, "weights")]
        assert layers and all(m.moe.weights.nvfp4_layout == "tiled" for m in layers), role
