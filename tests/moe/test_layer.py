"""MoELayer: against a plain torch MoE written here (routing included), shared experts, both modes
from one layer, construction-time pairing rejections and call-time layout errors."""

import pytest
import torch

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.config import MoEConfig
from pdlab.moe.dispatch.selftest import random_moe
from pdlab.moe.layer import MoELayer, slice_experts

CFG = MoEConfig(num_experts=8, top_k=3, hidden_size=128, intermediate_size=64, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def moe():
    return random_moe(3, CFG)


def plain_torch_moe(x, gate, bias, w13, w2, cfg, shared=None):
    """Token by token: sigmoid scores, group-limited choice with the bias, renormalised weights."""
    out = torch.zeros(x.shape[0], cfg.hidden_size)
    G = cfg.num_experts // cfg.n_group
    for t in range(x.shape[0]):
        xt = x[t].float()
        scores = torch.sigmoid(gate.float() @ xt)
        choice = scores + bias
        groups = choice.view(cfg.n_group, G).sort(descending=True).values[:, :2].sum(1)
        kept = groups.argsort(descending=True)[:cfg.topk_group]
        allowed = torch.full_like(choice, float("-inf"))
        for g in kept:
            allowed[g * G:(g + 1) * G] = choice[g * G:(g + 1) * G]
        experts = allowed.argsort(descending=True)[:cfg.top_k]
        wts = scores[experts] / scores[experts].sum() * cfg.routed_scaling_factor
        for e, wt in zip(experts.tolist(), wts):
            h = w13[e] @ xt
            act = torch.nn.functional.silu(h[:cfg.intermediate_size]) * h[cfg.intermediate_size:]
            out[t] += wt * (w2[e] @ act)
        if shared is not None:
            out[t] += shared.weight.float() @ x[t].float()
    return out


def _dense(weights):
    return weights.dequantized(torch.float32)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("payload,tol", [("bf16", 2e-2), ("fp8", 5e-2), ("nvfp4", 0.25)])
def test_layer_matches_plain_torch_moe(moe, mode, payload, tol):
    weights, gate, bias = moe
    shared = torch.nn.Linear(CFG.hidden_size, CFG.hidden_size, bias=False).to(torch.bfloat16)
    x = torch.randn(12, CFG.hidden_size).to(torch.bfloat16)
    layer = MoELayer(CFG, weights, gate, bias, shared, "local", "torch", mode, payload=payload,
                     num_max_dispatch_tokens_per_rank=16)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    w13, w2 = _dense(weights)
    with torch.no_grad():
        ref = plain_torch_moe(x, gate, bias, w13, w2, CFG, shared)
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < tol, rel  # bf16 output rounding; fp8 / nvfp4 add the payload's quantization error


def test_runner_choice_does_not_change_the_answer(moe):
    weights, gate, bias = moe
    x = torch.randn(9, CFG.hidden_size).to(torch.bfloat16)
    a = MoELayer(CFG, weights, gate, bias, dispatcher="local", runner="torch")(x)
    b = MoELayer(CFG, weights, gate, bias, dispatcher="local", runner="torch_grouped")(x)
    torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * float(a.abs().max()))


def test_one_layer_serves_both_modes_and_times_its_stages(moe):
    weights, gate, bias = moe
    layer = MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal", modes="both",
                     num_max_dispatch_tokens_per_rank=16)
    seen = []

    class Hook:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            seen.append(self.name)

        def __exit__(self, *exc):
            return False

    layer.stage_hook = Hook
    x = torch.randn(7, CFG.hidden_size).to(torch.bfloat16)
    a, b = layer(x, mode="normal"), layer(x, mode="low_latency")
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert seen[:5] == ["route", "quantize", "dispatch", "experts", "combine"]
    only_normal = MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal")
    with pytest.raises(ValueError, match="modes='both'"):
        only_normal(x, mode="low_latency")


def test_pairings_that_cannot_work_fail_at_construction(moe):
    weights, gate, bias = moe
    with pytest.raises(ValueError, match=r"dispatcher 'local' in normal mode with runner 'cutedsl'.*Fix"):
        MoELayer(CFG, weights, gate, bias, None, "local", "cutedsl", "normal")
    with pytest.raises(ValueError, match=r"runner 'torch_grouped'.*payload 'nvfp4'"):
        MoELayer(CFG, weights, gate, bias, None, "local", "torch_grouped", "normal", payload="nvfp4")
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=128.*max_num_tokens=4096.*normal mode"):
        MoELayer(CFG, weights, gate, bias, None, "local", "torch", "low_latency", max_num_tokens=4096)
    with pytest.raises(ValueError, match="use dispatcher='nccl'"):
        MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal", ep_rank=0, ep_size=2)
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal", ep_rank=0, ep_size=3)
    with pytest.raises(ShapeError, match="gate_weight"):
        MoELayer(CFG, weights, gate.t(), bias)


def test_wrong_layout_at_call_time_is_a_shape_error(moe):
    weights, gate, bias = moe
    layer = MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal", modes="both",
                     num_max_dispatch_tokens_per_rank=16)
    x = torch.randn(5, CFG.hidden_size).to(torch.bfloat16)
    ids, w = layer.route(x)
    masked, handle = layer.dispatch(layer.quantize(x), ids, w, mode="low_latency")
    with pytest.raises(ShapeError, match="Masked"):
        layer.experts(masked, mode="normal")
    contiguous, _ = layer.dispatch(layer.quantize(x), ids, w, mode="normal")
    with pytest.raises(ShapeError, match="masked layout"):
        layer.combine(layer.experts(contiguous, mode="normal"), handle)
    with pytest.raises(ShapeError, match="hidden_size"):
        layer(torch.randn(5, 2 * CFG.hidden_size))


def test_local_expert_slice(moe):
    weights, gate, bias = moe
    part = slice_experts(weights, 4, 8)
    assert part.num_experts == 4 and torch.equal(part.w13_weight, weights.w13_weight[4:8])
    assert torch.equal(part.w2_weight_scale_2, weights.w2_weight_scale_2[4:8])
    layer = MoELayer(CFG, weights, gate, bias, None, "local", "torch", "normal")
    assert layer.weights.num_experts == 8


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_layer_names_the_experts_a_step_reaches(moe, mode):
    # the tuned-config bucket of a decode step: T tokens reach at most T·top_k of the local experts
    from pdlab.kernels import tuned

    weights, gate, bias = moe
    layer = MoELayer(CFG, weights, gate, bias, None, "local", "torch", mode, num_max_dispatch_tokens_per_rank=16)
    for T, active in ((1, 3), (2, 6), (12, 8)):
        with tuned.observe() as seen, torch.no_grad():
            layer(torch.randn(T, CFG.hidden_size).to(torch.bfloat16))
        asked = [b for op, _, b in seen if op == "moe_experts"]
        assert asked and all(b["active_experts"] == active and b["experts"] == CFG.num_experts for b in asked), asked
