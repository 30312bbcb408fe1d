"""run_experts on strided bookkeeping and payload tensors: the same answer as contiguous ones, or a ShapeError
naming the argument (never a silent wrong answer from a kernel that indexes them densely)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any pdlab Triton kernel is defined

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.experts import run_experts
from pdlab.moe.layouts import Contiguous, Masked, quantize_payload, to_masked
from pdlab.moe.testing import random_experts_problem

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _strided(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The values of t in a view whose `dim` has stride 2 (not contiguous)."""
    shape = list(t.shape)
    shape[dim] *= 2
    big = torch.zeros(shape, dtype=t.dtype, device=t.device)
    index = [slice(None)] * t.dim()
    index[dim] = slice(None, None, 2)
    big[tuple(index)] = t
    return big[tuple(index)]


@pytest.fixture(scope="module")
def problem():
    return random_experts_problem(4, 64, 32, 6, 2, "nvfp4", DEV)


@pytest.mark.parametrize("runner", ["torch", "triton"])
@pytest.mark.parametrize("field", ["counts", "offsets", "scales"])
def test_strided_contiguous_layout_tensors_are_rejected(problem, runner, field):
    lay, w = problem
    kw = dict(hidden=lay.hidden, counts=lay.counts, offsets=lay.offsets, payload="nvfp4", scales=lay.scales,
              global_scale=lay.global_scale)
    kw[field] = _strided(kw[field])
    with pytest.raises(ShapeError, match=f"'{field}' must (be contiguous|have a contiguous last dim)"):
        run_experts(Contiguous(**kw), w, runner=runner)


@pytest.mark.parametrize("runner", ["torch", "triton"])
@pytest.mark.parametrize("field", ["masked_m", "scales"])
def test_strided_masked_layout_tensors_are_rejected(problem, runner, field):
    lay, w = problem
    m = to_masked(lay)
    kw = dict(hidden=m.hidden, masked_m=m.masked_m, payload="nvfp4", scales=m.scales, global_scale=m.global_scale)
    kw[field] = _strided(kw[field])
    with pytest.raises(ShapeError, match=f"'{field}' must (be contiguous|have a contiguous last dim)"):
        run_experts(Masked(**kw), w, runner=runner)


def test_strided_rows_give_the_contiguous_answer(problem):
    lay, w = problem
    n = int(lay.offsets[-1])
    ref = run_experts(lay, w, runner="torch").hidden[:n]
    strided = Contiguous(_strided(lay.hidden, 0), lay.counts, lay.offsets, "nvfp4", _strided(lay.scales, 0),
                         lay.global_scale)
    out = run_experts(strided, w, runner="triton").hidden[:n]
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.02)


def test_global_scale_of_another_dtype_or_device_is_named(problem):
    lay, w = problem
    for gs in (lay.global_scale.double(), lay.global_scale.to("meta")):
        bad = Contiguous(lay.hidden, lay.counts, lay.offsets, "nvfp4", lay.scales, gs)
        with pytest.raises(ShapeError, match="'global_scale'"):
            run_experts(bad, w, runner="torch")


def test_quantize_payload_of_zero_tokens():
    hidden, scales, gs = quantize_payload(torch.zeros(0, 64, device=DEV), "nvfp4")
    assert hidden.shape == (0, 32) and scales.shape == (0, 4) and gs.dtype == torch.float32


def test_a_config_for_a_runner_without_knobs_is_refused_not_ignored(problem):
    # torch_grouped has no knobs: a config (triton's, a typo) ran silently as if none was given, while the runners
    # with knobs and the reference refuse unknown keys
    lay, w = problem
    bf16 = Contiguous(hidden=torch.randn(lay.hidden.shape[0], 64, device=DEV).to(torch.bfloat16), counts=lay.counts,
                      offsets=lay.offsets)
    with pytest.raises(ValueError, match=r"moe_experts\[torch_grouped\]: unknown config keys \['BLOCK_M'\]"):
        run_experts(bf16, w, runner="torch_grouped", config={"BLOCK_M": 16})
    with pytest.raises(ValueError, match=r"moe_experts\[torch\]: unknown config keys \['BLOCK_M'\]"):
        run_experts(bf16, w, runner="torch", config={"BLOCK_M": 16})
    none = run_experts(bf16, w, runner="torch_grouped").hidden
    assert torch.equal(run_experts(bf16, w, runner="torch_grouped", config={}).hidden, none)
