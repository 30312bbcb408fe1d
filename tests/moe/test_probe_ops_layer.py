"""MoELayer on edge-case batches: zero tokens in either mode, strided tokens."""

import pytest
import torch

from pdlab.moe.config import MoEConfig
from pdlab.moe.dispatch.selftest import random_moe
from pdlab.moe.layer import MoELayer

CFG = MoEConfig(num_experts=8, top_k=3, hidden_size=128, intermediate_size=64, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def moe():
    return random_moe(3, CFG)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
def test_zero_tokens_give_an_empty_output(moe, mode, payload):
    layer = MoELayer(CFG, *moe, None, "local", "torch", mode, payload=payload)
    out = layer(torch.zeros(0, CFG.hidden_size))
    assert out.shape == (0, CFG.hidden_size)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_column_sliced_tokens_match_contiguous(moe, mode):
    layer = MoELayer(CFG, *moe, None, "local", "torch", mode)
    x = torch.randn(5, 2 * CFG.hidden_size)[:, CFG.hidden_size:]
    torch.testing.assert_close(layer(x), layer(x.contiguous()))
