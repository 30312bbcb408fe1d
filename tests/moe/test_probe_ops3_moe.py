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


def _sized(hidden: int, intermediate: int):
    from pdlab.moe.layouts import group_tokens
    from pdlab.moe.weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    w = ExpertWeights.from_bf16(torch.randn(2, 2 * intermediate, hidden, generator=g),
                                torch.randn(2, hidden, intermediate, generator=g), quantize=True)
    layout, _ = group_tokens(torch.randn(3, hidden, generator=g), torch.tensor([[0], [1], [0]]), 2)
    return layout, w


@pytest.mark.parametrize("hidden,intermediate,name", [(48, 32, "hidden_size=48"),
                                                      (32, 16, "moe_intermediate_size=16")])
def test_triton_runner_names_sizes_it_cannot_take(hidden, intermediate, name):
    """NVFP4 holds sizes in multiples of 16, the triton GEMMs need multiples of 32: the call failed inside the
    kernel wrapper with 'moe_nvfp4_gemm: K=48 must be a multiple of 32' (no argument, no fix)."""
    from pdlab.moe.experts import run_experts

    layout, w = _sized(hidden, intermediate)
    with pytest.raises(ShapeError, match=rf"moe_experts\[triton\] argument 'weights'.*{name}.*multiple of 32"
                                         r".*torch_grouped"):
        run_experts(layout, w, runner="triton")


def test_layer_refuses_the_triton_runner_for_sizes_it_cannot_take():
    from pdlab.moe.config import MoEConfig
    from pdlab.moe.layer import MoELayer

    cfg = MoEConfig(num_experts=2, top_k=1, hidden_size=48, intermediate_size=32, n_group=1, topk_group=1)
    _, w = _sized(48, 32)
    with pytest.raises(ValueError, match=r"runner 'triton'.*hidden_size=48.*multiple of 32"):
        MoELayer(cfg, w, torch.randn(2, 48), None, dispatcher="local", runner="triton")


def test_triton_runner_runs_sizes_of_32():
    from pdlab.moe.experts import run_experts

    layout, w = _sized(64, 32)
    ref = run_experts(layout, w, runner="torch").hidden
    out = run_experts(layout, w, runner="triton").hidden
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_torch_grouped_returns_the_activation_dtype_as_documented(dtype, masked):
    """run_experts documents bf16 output, 'fp16/fp32 when the input was'; torch_grouped returned bf16 always."""
    from pdlab.moe.experts import run_experts
    from pdlab.moe.layouts import to_masked

    layout, w = _experts(quantize=False)
    layout = layout.__class__(**{**layout.__dict__, "hidden": layout.hidden.to(dtype)})
    if masked:
        layout = to_masked(layout)
    out = run_experts(layout, w, runner="torch_grouped")
    assert out.hidden.dtype == dtype
    ref = run_experts(layout, w, runner="torch").hidden
    assert ref.dtype == dtype
    rows = slice(None) if not masked else (slice(None), slice(0, 1))  # every expert holds a row there
    scale = ref[rows].float().abs().max()
    assert (out.hidden[rows].float() - ref[rows].float()).abs().max() < 2e-2 * scale
