"""Routing on unusual but valid inputs: strided logits and correction bias give the contiguous answer."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.moe.routing import route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KW = dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_logits_and_bias_match_contiguous(backend, seed):
    logits = torch.randn(5, 32, device=DEV)[:, ::2]  # [5, 16], stride(-1) == 2
    bias = (torch.randn(32, device=DEV) * 0.5)[::2]  # [16], stride 2: the bias steers the choice
    assert not bias.is_contiguous()
    ids, w = route(logits, bias, backend=backend, **KW)
    ref_ids, ref_w = route(logits.contiguous(), bias.contiguous(), backend="torch", **KW)
    assert torch.equal(ids.sort(1).values, ref_ids.sort(1).values)
    torch.testing.assert_close(w.sort(1).values, ref_w.sort(1).values)
