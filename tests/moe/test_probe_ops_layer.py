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


def test_group_tokens_names_float_expert_ids():
    from pdlab.kernels.contracts import ShapeError
    from pdlab.moe.layouts import group_tokens

    x = torch.randn(4, 32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    with pytest.raises(ShapeError, match=r"topk_ids.*has dtype fp32.*integers"):
        group_tokens(x, ids.float(), 4)
    layout, _ = group_tokens(x, ids.int(), 4)
    assert layout.counts.tolist() == [2, 2, 2, 2]
