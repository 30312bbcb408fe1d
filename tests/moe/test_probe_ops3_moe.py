"""MoE dispatch, runners and routing on bad input: expert ids outside the experts, runner configs and sizes
a runner cannot take, output dtypes."""

import pytest
import torch

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.dispatch import create_dispatcher

E, H = 4, 32


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("bad", [4, 100, -1, -5])
def test_dispatch_names_expert_ids_outside_the_experts(mode, bad):
    """The local dispatcher dropped such a pair (its token lost that expert's share, nothing said); the nccl one
    failed inside a scatter. Host-known ids are checked for free."""
    d = create_dispatcher("local", E, H, mode=mode)
    ids = torch.tensor([[0, 1], [2, bad], [1, 2]], dtype=torch.int32)
    with pytest.raises(ShapeError, match=rf"moe_dispatch\[local\] argument 'topk_ids' has expert id {bad} at "
                                         rf"\[1, 1\].*0 <= id < 4"):
        d.dispatch(torch.randn(3, H), ids, torch.rand(3, 2))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_of_valid_ids_still_combines_to_the_weighted_sum(mode):
    from pdlab.moe.layouts import with_hidden

    d = create_dispatcher("local", E, H, mode=mode)
    x, w = torch.randn(3, H), torch.rand(3, 2)
    ids = torch.tensor([[0, 3], [2, 1], [3, 2]])
    layout, handle = d.dispatch(x, ids, w)
    out = d.combine(with_hidden(layout, layout.hidden.float()), handle)
    torch.testing.assert_close(out, (x[:, None] * w[..., None]).sum(1))
