"""Out-of-range numbers that used to pass silently: a routed_scaling_factor that is NaN, infinite or <= 0 (NaN,
inf or sign-flipped expert weights), and expert size hints <= 0 (a tuned-config bucket that names no real shape).
Each is a ValueError naming the argument and its valid range."""

import math

import pytest
import torch

from pdlab.moe.config import MoEConfig
from pdlab.moe.experts import launch_key, resolved_config, run_experts
from pdlab.moe.routing import route
from pdlab.moe.testing import random_experts_problem

BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0.0, -2.5]


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_route_refuses_a_scaling_factor_out_of_range(scale):
    with pytest.raises(ValueError, match=r"routed_scaling_factor=.* must be a finite number > 0"):
        route(torch.randn(3, 16), None, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=scale,
              backend="torch")


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_config_refuses_a_scaling_factor_out_of_range(scale):
    with pytest.raises(ValueError, match=r"routed_scaling_factor=.* must be a finite number > 0"):
        MoEConfig(num_experts=16, top_k=2, hidden_size=64, intermediate_size=32, routed_scaling_factor=scale)


def test_good_scaling_factor_scales():
    logits = torch.randn(3, 16)
    one = route(logits, None, top_k=2, n_group=4, topk_group=2, backend="torch")[1]
    big = route(logits, None, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, backend="torch")[1]
    torch.testing.assert_close(big, 2.5 * one)
    assert math.isclose(MoEConfig(num_experts=16, top_k=2, hidden_size=64, intermediate_size=32,
                                  routed_scaling_factor=1e-3).routed_scaling_factor, 1e-3)


@pytest.fixture(scope="module")
def problem():
    return random_experts_problem(4, 64, 32, 6, 2, "bf16", "cpu")


@pytest.mark.parametrize("name", ["expected_m", "active_experts"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_expert_size_hints_out_of_range_are_named(problem, name, value):
    lay, w = problem
    for call in (lambda: run_experts(lay, w, runner="torch", **{name: value}),
                 lambda: resolved_config(lay, w, "torch", **{name: value}),
                 lambda: launch_key(lay, w, "torch", **{name: value})):
        with pytest.raises(ValueError, match=rf"{name}={value!r} must be an integer >= 1"):
            call()


def test_expert_size_hints_in_range_run(problem):
    lay, w = problem
    ref = run_experts(lay, w, runner="torch").hidden
    out = run_experts(lay, w, runner="torch", expected_m=1, active_experts=4).hidden
    assert torch.equal(out, ref)
