"""Triton top-k routing kernel (noaux_tc, greedy, group_limited_greedy): one program per token
(see pdlab.moe.routing for the maths)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, scale,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, SOFTMAX: tl.constexpr,
                  GROUP_TOP2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    valid = (g < N_GROUP) & (s < GROUP_SIZE)
    e = g * GROUP_SIZE + s  # [BLOCK_G, BLOCK_S] expert index
    neg = float("-inf")
    if SOFTMAX:
        logit = tl.load(logits_ptr + t * E + e, mask=valid, other=neg)
        p = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))  # 0 outside the E experts
        score = p / tl.sum(tl.sum(p, axis=1), axis=0)
    else:
        score = tl.sigmoid(tl.load(logits_ptr + t * E + e, mask=valid, other=0.0))
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, neg)
    if N_GROUP > 1:
        m1 = tl.max(choice, axis=1)
        if GROUP_TOP2:
            first = tl.min(tl.where(choice == m1[:, None], s, BLOCK_S), axis=1)
            m1 = m1 + tl.max(tl.where(s == first[:, None], neg, choice), axis=1)
        gscore = tl.where(tl.arange(0, BLOCK_G) < N_GROUP, m1, neg)
        gidx = tl.arange(0, BLOCK_G)
        keep = tl.zeros([BLOCK_G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, gidx, BLOCK_G), axis=0)
            keep = keep | (gidx == pick)
            gscore = tl.where(gidx == pick, neg, gscore)
        choice = tl.where(keep[:, None], choice, neg)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    ws = tl.zeros([BLOCK_K], dtype=tl.float32)
    big = 1 << 30
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == best, e, big), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(e == pick, score, 0.0), axis=1), axis=0)
        ids = tl.where(kk == i, pick, ids)
        ws = tl.where(kk == i, w, ws)
        choice = tl.where(e == pick, neg, choice)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scale
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kk < TOP_K)
    tl.store(w_ptr + t * TOP_K + kk, ws, mask=kk < TOP_K)


def topk_route(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int, topk_group: int,
               routed_scaling_factor: float, renormalize: bool, softmax: bool = False, group_top2: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] fp32 | None → (ids [T, top_k] int32, weights [T, top_k] fp32).
    softmax: softmax scores (else sigmoid). group_top2: a group scores its best two experts' sum (else its best)."""
    T, E = logits.shape
    logits = logits.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernel indexes it densely (no copy when it already is)
    group_size = E // n_group
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    _route_kernel[(T,)](
        logits, bias if bias is not None else logits, ids, weights, E, routed_scaling_factor,
        HAS_BIAS=bias is not None, N_GROUP=n_group, GROUP_SIZE=group_size,
        BLOCK_G=triton.next_power_of_2(n_group), BLOCK_S=triton.next_power_of_2(group_size),
        TOPK_GROUP=topk_group if n_group > 1 else 1, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
        RENORM=renormalize, SOFTMAX=softmax, GROUP_TOP2=group_top2, num_warps=4 if E >= 128 else 1)
    return ids, weights
