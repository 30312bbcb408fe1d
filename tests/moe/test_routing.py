"""noaux_tc routing: torch reference and Triton kernel against transformers' DeepseekV3TopkRouter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.routing import route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # experts, top_k, n_group, topk_group, scaling, renormalize
    (64, 6, 8, 3, 2.5, True),
    (32, 4, 4, 2, 1.0, False),
    (16, 3, 1, 1, 1.5, True),
    (256, 8, 8, 4, 2.5, True),  # DeepSeek-V3/R1
]


def _hf_router(E, top_k, n_group, topk_group, scaling, renorm, hidden=32):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=hidden, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=renorm)
    gate = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.normal_(0, 1.0)
        gate.e_score_correction_bias.normal_(0, 0.2)
    return gate


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}k{c[1]}g{c[2]}/{c[3]}")
def test_matches_transformers_gate(seed, backend, case):
    E, top_k, n_group, topk_group, scaling, renorm = case
    gate = _hf_router(E, top_k, n_group, topk_group, scaling, renorm)
    x = torch.randn(37, 32)
    with torch.no_grad():
        logits, hf_w, hf_ids = gate(x)
    bias = gate.e_score_correction_bias.detach()
    ids, w = route(logits.to(DEV), bias.to(DEV), top_k=top_k, n_group=n_group, topk_group=topk_group,
                   routed_scaling_factor=scaling, renormalize=renorm, backend=backend)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (37, top_k)
    # transformers returns its top-k unsorted: compare as (id → weight) per token
    mine = torch.sort(ids.cpu().long(), dim=1)
    theirs = torch.sort(hf_ids.long(), dim=1)
    assert torch.equal(mine.values, theirs.values), f"seed {seed}"
    torch.testing.assert_close(w.cpu().gather(1, mine.indices), hf_w.gather(1, theirs.indices), rtol=1e-5, atol=1e-6)


def test_triton_equals_torch_bitwise_ids(seed):
    logits = torch.randn(200, 256, device=DEV)
    bias = 0.1 * torch.randn(256, device=DEV)
    a = route(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, backend="torch")
    b = route(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, backend="triton")
    assert torch.equal(a[0], b[0])  # both best-first
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)


def test_bias_steers_choice_not_weight():
    # expert 3 has the lowest score but a huge bias: it must be chosen, weighted by its raw score
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    ids, w = route(logits, bias, top_k=2, n_group=1, topk_group=1, renormalize=False, backend="torch")
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-3.0, 2.0]])))


def test_group_limit_excludes_strong_expert_in_weak_group():
    # groups {0,1} {2,3}: group 0 = 0.9+(-5) sums low despite expert 0 being the best single one
    logits = torch.tensor([[5.0, -9.0, 1.0, 1.5]])
    ids, _ = route(logits, None, top_k=2, n_group=2, topk_group=1, backend="torch")
    assert sorted(ids[0].tolist()) == [2, 3]


def test_bad_input_raises():
    with pytest.raises(ShapeError, match="correction_bias"):
        route(torch.randn(4, 16), torch.randn(8), top_k=2, n_group=4, topk_group=2)
    with pytest.raises(ShapeError, match="n_group"):
        route(torch.randn(4, 16), None, top_k=2, n_group=3, topk_group=2)
    with pytest.raises(ValueError, match="topk_group"):
        route(torch.randn(4, 16), None, top_k=2, n_group=4, topk_group=5)
