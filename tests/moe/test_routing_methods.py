"""The HF config's routing fields (scoring_func, topk_method, norm_topk_prob, routed_scaling_factor) are honoured:
DeepSeek-V2's softmax + greedy / group_limited_greedy against transformers' DeepseekV2TopkRouter, from `route` up to
a MoELayer built from a V2 config.json and `bench moe --model`; combinations pdlab does not run are refused, naming
the config field and its value."""

import json
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.moe.config import MoEConfig
from pdlab.moe.routing import route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V2_CASES = [  # experts, top_k, n_group, topk_group, topk_method, scaling
    (64, 6, 1, 1, "greedy", 1.0),  # DeepSeek-V2-Lite
    (32, 4, 4, 2, "greedy", 2.0),  # greedy ignores the groups, as transformers does
    (64, 6, 8, 3, "group_limited_greedy", 16.0),  # DeepSeek-V2 (160 experts there)
    (16, 3, 8, 2, "group_limited_greedy", 1.0),  # groups of two experts
]
# DeepSeek-V2-Lite's config.json, its MoE fields (no e_score_correction_bias in the checkpoint)
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
           "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
           "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
           "routed_scaling_factor": 1.0}


def _hf_v2_router(E, top_k, n_group, topk_group, method, scaling, hidden=32):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=hidden, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, topk_method=method, routed_scaling_factor=scaling,
                           norm_topk_prob=False)
    gate = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.normal_(0, 1.0)
    return gate


def _same_routing(ids, w, hf_ids, hf_w):
    """transformers returns its top-k unsorted: compare as (id -> weight) per token."""
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == hf_ids.shape
    mine = torch.sort(ids.cpu().long(), dim=1)
    theirs = torch.sort(hf_ids.long(), dim=1)
    assert torch.equal(mine.values, theirs.values)
    torch.testing.assert_close(w.cpu().gather(1, mine.indices), hf_w.gather(1, theirs.indices), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", V2_CASES, ids=lambda c: f"E{c[0]}k{c[1]}g{c[2]}/{c[3]}-{c[4]}")
def test_softmax_routing_matches_transformers_v2_gate(seed, backend, case):
    E, top_k, n_group, topk_group, method, scaling = case
    gate = _hf_v2_router(E, top_k, n_group, topk_group, method, scaling)
    with torch.no_grad():
        logits, hf_w, hf_ids = gate(torch.randn(37, 32))
    ids, w = route(logits.to(DEV), None, top_k=top_k, n_group=n_group, topk_group=topk_group,
                   routed_scaling_factor=scaling, renormalize=False, scoring_func="softmax", topk_method=method,
                   backend=backend)
    _same_routing(ids, w, hf_ids, hf_w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_softmax_renormalised_by_hand(backend):
    # norm_topk_prob true (DeepSeek's V2 code: the top-k softmax weights divided by their sum); logits 0, 1, 2, 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=DEV)
    ids, w = route(logits, None, top_k=2, n_group=1, topk_group=1, renormalize=True, scoring_func="softmax",
                   topk_method="greedy", backend=backend)
    assert ids.tolist() == [[3, 2]]
    e = math.e
    torch.testing.assert_close(w.cpu(), torch.tensor([[e / (e + 1), 1 / (e + 1)]]))
    # group_limited_greedy scores a group by its best expert (V3's noaux_tc sums its best two): groups {0,1} {2,3}
    # score 0.5 and 0.3 though {2,3}'s two sum higher, and group {0,1} is kept
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2]]) + 1e-9
    ids, w = route(p.log().to(DEV), None, top_k=2, n_group=2, topk_group=1, renormalize=False,
                   routed_scaling_factor=2.0, scoring_func="softmax", topk_method="group_limited_greedy",
                   backend=backend)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w.cpu(), 2.0 * p[:, :2] / p.sum(), atol=1e-6, rtol=1e-5)


def test_config_from_hf_reads_the_routing_fields():
    cfg = MoEConfig.from_hf(V2_LITE)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("softmax", "greedy", False)
    # a V2 config without them means transformers' DeepseekV2 defaults (softmax, greedy, no renormalisation)
    bare = {k: v for k, v in V2_LITE.items() if k not in ("scoring_func", "topk_method", "norm_topk_prob")}
    cfg = MoEConfig.from_hf(bare)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("softmax", "greedy", False)
    v3 = MoEConfig.from_hf({"model_type": "deepseek_v3", "hidden_size": 64, "moe_intermediate_size": 32,
                            "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2})
    assert (v3.scoring_func, v3.topk_method, v3.norm_topk_prob) == ("sigmoid", "noaux_tc", True)


def test_layer_from_a_v2_config_routes_like_transformers(seed):
    from pdlab.moe.dispatch.selftest import random_moe
    from pdlab.moe.layer import MoELayer

    hf = dict(V2_LITE, hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
              n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    cfg = MoEConfig.from_hf(hf)
    weights, gate_weight, _bias = random_moe(1, cfg)
    layer = MoELayer(cfg, weights, gate_weight, None, runner="torch")
    gate = _hf_v2_router(16, 4, 4, 2, "group_limited_greedy", 16.0, hidden=64)
    with torch.no_grad():
        gate.weight.copy_(gate_weight)
        x = torch.randn(21, 64)
        _, hf_w, hf_ids = gate(x)
    ids, w = layer.route(x)
    _same_routing(ids, w, hf_ids, hf_w)


@pytest.mark.parametrize("changes, says", [
    ({"scoring_func": "softmax", "topk_method": "noaux_tc"}, "topk_method='noaux_tc' with scoring_func='softmax'"),
    ({"scoring_func": "sigmoid", "topk_method": "greedy"}, "topk_method='greedy' with scoring_func='sigmoid'"),
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func='sqrtsoftplus'"),
    ({"topk_method": "aux_free"}, "topk_method='aux_free'"),
    ({"norm_topk_prob": True, "routed_scaling_factor": 16.0}, "norm_topk_prob=True with routed_scaling_factor=16"),
])
def test_unsupported_routing_is_refused_naming_the_field(changes, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        MoEConfig.from_hf(dict(V2_LITE, **changes))


def test_route_refuses_what_it_does_not_run():
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="topk_method='noaux_tc' with scoring_func='softmax'"):
        route(logits, None, top_k=2, n_group=1, topk_group=1, scoring_func="softmax", topk_method="noaux_tc")
    with pytest.raises(ValueError, match="correction_bias.*noaux_tc"):
        route(logits, torch.zeros(16), top_k=2, n_group=1, topk_group=1, scoring_func="softmax",
              topk_method="greedy")


def test_layer_refuses_a_correction_bias_for_softmax_routing():
    from pdlab.moe.dispatch.selftest import random_moe
    from pdlab.moe.layer import MoELayer

    cfg = MoEConfig.from_hf(dict(V2_LITE, hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                 num_experts_per_tok=2))
    weights, gate_weight, bias = random_moe(1, cfg)
    with pytest.raises(ValueError, match="correction_bias.*topk_method='greedy'"):
        MoELayer(cfg, weights, gate_weight, bias, runner="torch")


def _write(tmp_path, hf):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    return path


def test_bench_moe_runs_a_v2_config_with_its_own_routing(tmp_path, capsys):
    from pdlab.bench.cli import main

    hf = dict(V2_LITE, hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    out = tmp_path / "out"
    assert main(["moe", "--model", str(_write(tmp_path, hf)), "--tokens", "4", "--mode", "normal", "--dispatch",
                 "bf16", "--repeats", "1", "--warmup", "0", "--no-plot", "--out", str(out), "--name", "v2"]) == 0
    meta = json.loads((out / "v2.json").read_text())
    cfg = meta["plan"]["cfg"] if "plan" in meta else meta["meta"]["plan"]["cfg"]
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["norm_topk_prob"]) == ("softmax", "greedy", False)


def test_bench_moe_refuses_unsupported_routing_naming_the_field(tmp_path, capsys):
    from pdlab.bench.cli import main

    hf = dict(V2_LITE, hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              topk_method="noaux_tc")
    path = _write(tmp_path, hf)
    assert main(["moe", "--model", str(path), "--tokens", "1", "--no-plot", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("bench moe: --model") and "topk_method='noaux_tc'" in line
