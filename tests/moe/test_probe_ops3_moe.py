"""MoE dispatch, runners and routing on bad input: expert ids outside the experts, runner configs and sizes
a runner cannot take, output dtypes."""

import pytest
import torch

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.dispatch import create_dispatcher

E, H = 4, 32


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("bad", [4, 100, -1, -5])
def test_dispatch_names_expert_ids_outside_the_experts(mode, bad):
    """The local dispatcher dropped such a pair (its token lost that expert's share, nothing said); the nccl one
    failed inside a scatter. Host-known ids are checked for free."""
    d = create_dispatcher("local", E, H, mode=mode)
    ids = torch.tensor([[0, 1], [2, bad], [1, 2]], dtype=torch.int32)
    with pytest.raises(ShapeError, match=rf"moe_dispatch\[local\] argument 'topk_ids' has expert id {bad} at "
                                         rf"\[1, 1\].*0 <= id < 4"):
        d.dispatch(torch.randn(3, H), ids, torch.rand(3, 2))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_of_valid_ids_still_combines_to_the_weighted_sum(mode):
    from pdlab.moe.layouts import with_hidden

    d = create_dispatcher("local", E, H, mode=mode)
    x, w = torch.randn(3, H), torch.rand(3, 2)
    ids = torch.tensor([[0, 3], [2, 1], [3, 2]])
    layout, handle = d.dispatch(x, ids, w)
    out = d.combine(with_hidden(layout, layout.hidden.float()), handle)
    torch.testing.assert_close(out, (x[:, None] * w[..., None]).sum(1))


def _experts(quantize: bool, keep_bf16: bool = True):
    from pdlab.moe.layouts import group_tokens
    from pdlab.moe.weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    w = ExpertWeights.from_bf16(torch.randn(2, 32, H, generator=g), torch.randn(2, H, 16, generator=g),
                                quantize=quantize)
    if not keep_bf16:
        w.w13 = w.w2 = None
    layout, _ = group_tokens(torch.randn(3, H, generator=g), torch.tensor([[0], [1], [0]]), 2)
    return layout, w


@pytest.mark.parametrize("form", ["bogus", "fp8", None])
def test_torch_runner_names_an_unknown_weight_form(form):
    """An unknown value ran the NVFP4 weights (or the bf16 ones) as if it were 'auto'."""
    from pdlab.moe.experts import run_experts

    layout, w = _experts(quantize=True)
    with pytest.raises(ValueError, match=r"moe_experts\[torch\].*weights.*'auto', 'bf16', 'nvfp4'"):
        run_experts(layout, w, runner="torch", config={"weights": form})


@pytest.mark.parametrize("form,quantize,keep_bf16", [("nvfp4", False, True), ("bf16", True, False)])
def test_torch_runner_names_a_weight_form_the_weights_lack(form, quantize, keep_bf16):
    """'nvfp4' on bf16-only weights ran the bf16 ones silently; 'bf16' on NVFP4-only weights raised AttributeError
    from inside the runner."""
    from pdlab.moe.experts import run_experts

    layout, w = _experts(quantize, keep_bf16)
    with pytest.raises(ValueError, match=rf"moe_experts\[torch\].*weights={form!r}.*these weights have no {form}"):
        run_experts(layout, w, runner="torch", config={"weights": form})


def test_torch_runner_weight_forms_differ_by_the_quantization():
    from pdlab.moe.experts import run_experts

    layout, w = _experts(quantize=True)
    auto, nv, bf = (run_experts(layout, w, runner="torch", config={"weights": f}).hidden
                    for f in ("auto", "nvfp4", "bf16"))
    assert torch.equal(auto, nv) and not torch.equal(nv, bf)
