"""DeepSeek top-k routing, as the HF config's scoring_func / topk_method name it.

DeepSeek-V3 `sigmoid` + `noaux_tc` (the default):
    scores  = sigmoid(router_logits)                    [T, E] fp32
    choice  = scores + correction_bias                  (bias only steers the choice)
    group   = sum of the top-2 `choice` values in each of n_group groups of E/n_group experts
    keep the topk_group best groups, then the top_k experts by `choice` inside them
    weights = scores at those experts, / their sum (renormalize), · routed_scaling_factor

DeepSeek-V2 `softmax` + `greedy` (V2-Lite) or `group_limited_greedy` (V2): scores = softmax(router_logits), no
correction bias; greedy takes the top_k experts by score (groups ignored), group_limited_greedy first keeps the
topk_group groups with the best single score; weights as above (V2 configs do not renormalise).

Matches transformers' `DeepseekV3TopkRouter` and `DeepseekV2TopkRouter` (ids as a set per token; the order within
a token is best-first here, unspecified there).
"""

from __future__ import annotations

import math
import os

import torch

from pdlab.kernels import registry
from pdlab.kernels.contracts import Op, Spec
from pdlab.moe.config import routing_problem, scaling_problem

ROUTE = Op(
    "moe_route",
    inputs={"router_logits": Spec("T E", "fp32|bf16|fp16"), "correction_bias": Spec("E", "fp32|bf16", optional=True)},
    outputs={"topk_ids": Spec("T k", "int32"), "topk_weights": Spec("T k", "fp32")},
    hints={"router_logits": "router_logits are the gate GEMM output x @ gate_weight.T, one row per token.",
           "correction_bias": "e_score_correction_bias has one entry per expert."},
)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, n_group: int,
          topk_group: int, routed_scaling_factor: float = 1.0, renormalize: bool = True,
          scoring_func: str = "sigmoid", topk_method: str = "noaux_tc",
          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token (DeepSeek-V3 noaux_tc by default; DeepSeek-V2's softmax routings).

    Args:
        router_logits: [T, E] fp32 (bf16/fp16 are upcast). correction_bias: [E] fp32 or None (noaux_tc only).
        top_k: experts per token. n_group: expert groups (E % n_group == 0). topk_group: groups kept
            (both ignored by topk_method "greedy").
        routed_scaling_factor: multiplies the final weights; a finite number > 0. renormalize: divide by their sum first
            (the HF config's norm_topk_prob).
        scoring_func / topk_method: the HF config's fields: "sigmoid"/"noaux_tc", "softmax"/"greedy" or
            "softmax"/"group_limited_greedy"; any other pair is a ValueError naming it.
        backend: "torch" | "triton" | None (best available).
    Returns:
        topk_ids [T, top_k] int32 (best first), topk_weights [T, top_k] fp32.
    """
    scale = float(routed_scaling_factor)
    if not 0.0 < scale < math.inf:
        raise ValueError(f"moe_route: {scaling_problem(routed_scaling_factor)}")
    if scoring_func != "sigmoid" or topk_method != "noaux_tc":
        problem = routing_problem(scoring_func, topk_method, routed_scaling_factor, renormalize)
        if problem:
            raise ValueError(f"moe_route: {problem}")
        if correction_bias is not None:
            raise ValueError(f"moe_route: correction_bias (e_score_correction_bias) steers noaux_tc routing only; "
                             f"topk_method={topk_method!r} has none: pass None")
        if topk_method == "greedy":
            n_group = topk_group = 1
    dims = ROUTE.check(backend, router_logits=router_logits, correction_bias=correction_bias)
    E = dims["E"]
    ROUTE.require(backend, n_group >= 1 and E % n_group == 0, "router_logits", f"has E={E} experts, not divisible "
                  f"by n_group={n_group}", router_logits, f"[T, E] with E % {n_group} == 0")
    group_size = E // n_group
    top2 = topk_method == "noaux_tc"  # a group's score: its best two experts' sum (V3), or its best one (V2)
    if not (1 <= topk_group <= n_group) or not (1 <= top_k <= topk_group * group_size) or (
            top2 and n_group > 1 and group_size < 2):
        raise ValueError(f"moe_route: need 1 <= topk_group ({topk_group}) <= n_group ({n_group}), "
                         f"1 <= top_k ({top_k}) <= topk_group·E/n_group ({topk_group * group_size})"
                         + (" and at least 2 experts per group when n_group > 1" if top2 else ""))
    impl = _select("moe_route", backend, router_logits.device)
    return impl(router_logits.float(), None if correction_bias is None else correction_bias.float(),
                top_k=top_k, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=scale, renormalize=renormalize,
                softmax=scoring_func == "softmax", group_top2=top2)


@registry.register_backend("moe_route", "torch", archs=("cpu", "cuda"), priority=0, reference=True)
def route_torch(logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, renormalize, softmax=False,
                group_top2=True):
    """Reference routing in fp32 torch (softmax or sigmoid scores; group score = best two's sum or best one)."""
    T, E = logits.shape
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if group_top2 else grouped.amax(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * routed_scaling_factor


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@registry.register_backend("moe_route", "triton", archs=("cuda",), packages=("triton",), priority=10)
def route_triton(logits, bias, *, top_k, n_group, topk_group, routed_scaling_factor, renormalize, softmax=False,
                 group_top2=True):
    """One Triton program per token: scores, group scores, group mask, iterative top-k, renormalisation."""
    from pdlab.moe.triton.route import topk_route

    return topk_route(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, softmax=softmax,
                      group_top2=group_top2)


def _select(op: str, name: str | None, device: torch.device):
    """The backend impl by name (error if unusable), or the best usable on `device`. Under
    TRITON_INTERPRET=1 Triton backends run on CPU tensors (tests)."""
    if name is not None and device.type == "cpu" and _interpreting() and name == "triton":
        return registry.get_backend(op, name).impl
    if name is None and device.type == "cpu":
        return registry.select(op, device="cpu").impl
    return registry.select(op, name, device=device).impl
