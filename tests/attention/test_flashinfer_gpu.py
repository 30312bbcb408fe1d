"""The flashinfer MLA backend (fa3 on sm90) on a real GPU against the torch fp32 reference, with FlashMLA's bar
1 - 2Σxy/Σ(x²+y²) < 1e-5 on out and lse. Skipped, with the reason, where flashinfer is not installed; its first
call JIT-compiles the kernel with nvcc (minutes)."""

import random

import pytest
import torch

from pdlab.attention import mla_decode, mla_prefill
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.bench.harness import cosine_error
from pdlab.kernels import registry

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _needs_flashinfer():
    reason = registry.unavailable_reason("mla_decode", "flashinfer")
    if reason:
        pytest.skip(f"flashinfer backend unavailable: {reason}")


def _lens(B, top, q_len, rng):
    fixed = [q_len, 63, 64, 65, top]
    return [max(q_len, n) for n in fixed + [rng.randint(1, top) for _ in range(B - len(fixed))]]


@pytest.mark.parametrize("heads,q_len,page", [(16, 1, 64), (128, 1, 64), (16, 2, 64), (128, 1, 1), (16, 1, 16)])
def test_flashinfer_decode_bf16(heads, q_len, page, seed):
    rng = random.Random(seed)
    p = decode_problem(_lens(32, 4096, q_len, rng), heads, q_len, page, torch.bfloat16, device=DEV, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, backend="torch")
    out, lse = mla_decode(*args, backend="flashinfer")
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


def test_flashinfer_decode_follows_in_place_step_updates(seed):
    """The plan is reused while the step's metadata is unchanged and redone when the engine bumps seqlens in
    place: the second step must see the longer sequences."""
    rng = random.Random(seed)
    p = decode_problem(_lens(8, 1000, 1, rng), 16, 1, 64, torch.bfloat16, device=DEV, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    mla_decode(*args, backend="flashinfer")
    p.seqlens.copy_(torch.clamp(p.seqlens - 7, min=1))  # in place, as the engine does: the version moves on
    ref = mla_decode(*args, backend="torch")
    out, lse = mla_decode(*args, backend="flashinfer")
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5


@pytest.mark.parametrize("heads", [16, 128])
def test_flashinfer_prefill_bf16(heads, seed):
    seqlens, new = [2048, 1000, 513, 64, 1], [512, 1000, 1, 64, 1]
    p = prefill_problem(seqlens, new, heads, 64, torch.bfloat16, device=DEV, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref = mla_prefill(*args, backend="torch")
    out, lse = mla_prefill(*args, backend="flashinfer")
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))
