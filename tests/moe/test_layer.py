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
    # token ids where hidden states belong: named at the layer's input (was: the expert runner's 'hidden' argument)
    with pytest.raises(ShapeError, match=r"moe_layer argument 'x' has the wrong dtype.*int64"):
        layer(torch.ones(5, CFG.hidden_size, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown mode 'prefill'; choose one of normal, low_latency"):
        layer(x, mode="prefill")


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


def test_warmup_token_counts_name_the_first_step_of_each_expert_launch(moe, monkeypatch, tmp_path):
    """The start-up warm-up runs a prefill step of each size returned: on an H200 a server warmed at powers of two
    still compiled five fragment GEMMs under the first load (TTFT p99 2.1 s, 37 ms once warm), its tuned configs
    changing at bucket boundaries no power of two reaches."""
    from pdlab.kernels import tuned
    from pdlab.tuning import store

    weights, gate, bias = moe
    layer = MoELayer(CFG, weights, gate, bias, dispatcher="local", runner="torch")
    assert layer.warmup_token_counts(4096) == [1]  # the reference launches the same code at every size
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PDLAB_CONFIG_DIR", str(tmp_path))
    tuned.clear_cache()
    monkeypatch.setitem(layer.runners, "normal", "triton")
    # T tokens expect ceil(3T/8) per expert: 1 (T=1), 2 (T=3: asynchronous MMAs), 17 (T=43: 32-token programs),
    # 33 (T=86: 64-token programs), 65 (T=171: prefill tiles), 256 (T=681: dequantise + grouped GEMM)
    assert layer.warmup_token_counts(16384) == [1, 3, 43, 86, 171, 681]
    assert layer.warmup_token_counts(100) == [1, 3, 43, 86]
    # two tuned entries (4 and 8 tokens per expert, 8 experts holding tokens), other configs: each step takes the
    # nearest one (Σ|log2 ratio|), B from ceil(3T/8) = 6 on (T = 14), a boundary no power of two reaches
    meta = {"device": "cpu", "device_key": "cpu", "arch": "cpu", "versions": tuned.running_versions(["torch"])}
    results = {}
    for m, cfg in ((4, {"FRAG_PDL": 1}), (8, {"FRAG_PDL": 0})):
        bucket = {"layout": "contiguous", "payload": "bf16", "experts": 8, "hidden": 128, "intermediate": 64,
                  "tokens_per_expert": m, "active_experts": 8}
        results.update(store.merge_bucket(bucket, {"triton": store.backend_result(cfg, 1.0, 2.0)}))
    store.write_results(tmp_path, "cpu", "moe_experts", meta, results)
    tuned.clear_cache()
    try:
        with_entry = layer.warmup_token_counts(16384)
    finally:
        tuned.clear_cache()
    assert with_entry == [1, 3, 14, 43, 86, 171, 681]
