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


def _near_ties(logits, bias, *, top_k, n_group, topk_group, tol=1e-6):
    """[T] bool: tokens whose choice hangs on a near-tie (within `tol`, a few ulps of the scores): the last kept
    group against the first dropped one, or two neighbours in the order of the top_k + 1 best kept experts. Two
    correct implementations whose sigmoid differs by an ulp may pick or order those differently."""
    choice = torch.sigmoid(logits.float()) + bias.float()
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    gscore = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
    group_tie = (gscore[:, topk_group - 1] - gscore[:, topk_group]) < tol
    kept = torch.zeros(T, n_group, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices, True)
    best = grouped.masked_fill(~kept[..., None], float("-inf")).reshape(T, E).topk(top_k + 1, dim=-1).values
    order_tie = ((best[:, :-1] - best[:, 1:]) < tol).any(-1)
    return group_tie | order_tie


def test_triton_equals_torch_bitwise_ids(seed):
    # ids equal, best first, on every token whose choice is not a near-tie (random inputs: some seeds give a
    # token with two scores an ulp apart, which the kernels' sigmoids may order differently)
    logits = torch.randn(200, 256, device=DEV)
    bias = 0.1 * torch.randn(256, device=DEV)
    a = route(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, backend="torch")
    b = route(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, backend="triton")
    tie = _near_ties(logits, bias, top_k=8, n_group=8, topk_group=4)
    assert tie.sum() <= 10, f"{int(tie.sum())} near-ties out of 200 tokens: the inputs are not random"
    clear = ~tie
    assert torch.equal(a[0][clear], b[0][clear])  # both best-first
    torch.testing.assert_close(a[1][clear], b[1][clear], rtol=1e-6, atol=1e-6)
    # on a near-tie the two may differ only among the tied experts: the same set of scores, within the tie
    sa = (torch.sigmoid(logits) + bias).gather(1, a[0].long())
    sb = (torch.sigmoid(logits) + bias).gather(1, b[0].long())
    same_set = torch.equal(a[0][tie].sort(-1).values, b[0][tie].sort(-1).values)
    assert same_set or torch.allclose(sa[tie].sum(-1), sb[tie].sum(-1), atol=1e-5)


def test_near_tie_detection():
    # the helper above flags what it should: the 2nd and 3rd best expert tied (top_k 2), and two groups tied for
    # the last kept place; a clear token is not flagged
    logits = torch.full((3, 16), -4.0)
    logits[:, :8] = torch.linspace(4.0, 1.0, 8)  # token 0: clear, all in groups 0-1
    logits[1, 2] = logits[1, 1]  # token 1: the 3rd best equals the 2nd
    logits[2] = torch.tensor([4.0, 3.0, -4, -4, 2.0, 1.0, -4, -4, 2.0, 1.0, -4, -4, -4, -4, -4, -4])  # groups 1, 2 tie
    tie = _near_ties(logits, torch.zeros(16), top_k=2, n_group=4, topk_group=2)
    assert tie.tolist() == [False, True, True]


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
