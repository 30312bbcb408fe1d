"""The flashinfer MLA backend (fa3 on sm90) on a real GPU against the torch fp32 reference, with FlashMLA's bar
1 - 2Σxy/Σ(x²+y²) < 1e-5 on out and lse. Skipped, with the reason, where flashinfer is not installed; its first
call JIT-compiles the kernel with nvcc (minutes)."""

import random

import pytest
import torch

from pdlab.attention import mla_decode, mla_prefill, quantize_kv_fp8
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


@pytest.mark.parametrize("heads,scale_as", [(16, "float"), (128, "tensor")])
def test_flashinfer_decode_fp8_cache(heads, scale_as, seed):
    """An fp8 pool (e4m3 bytes, one kv_scale) against the reference on the same dequantised bytes, with the bar of
    the bf16 tests. flashinfer multiplies each converted value by the scale rounded to bf16 (a relative error of
    up to 2^-9 in every logit, which at 128 heads can reach the bar by itself): the reference dequantises with that
    rounded scale (`_as_flashinfer_rounds`); a wrong scale still fails by orders of magnitude."""
    rng = random.Random(seed)
    p = decode_problem(_lens(32, 8192, 1, rng), heads, 1, 64, torch.bfloat16, device=DEV, seed=seed)
    scale = float(p.kv_cache.float().nan_to_num(0).abs().max()) / 448
    kv = quantize_kv_fp8(p.kv_cache, scale)  # NaN poison stays NaN (0x7F)
    kv_scale = torch.tensor([scale], device=DEV) if scale_as == "tensor" else scale
    args = (p.q, kv, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, kv_scale=_as_flashinfer_rounds(scale), backend="torch")
    out, lse = mla_decode(*args, kv_scale=kv_scale, backend="flashinfer")
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


def _as_flashinfer_rounds(scale: float) -> float:
    """The fp8 dequantisation scale as flashinfer applies it: rounded to bf16."""
    return float(torch.tensor(scale).to(torch.bfloat16))


def test_flashinfer_prefill_fp8_cache(seed):
    """As the fp8 decode test, for a ragged causal prefill at 128 heads."""
    p = prefill_problem([2048, 700, 64], [512, 700, 1], 128, 64, torch.bfloat16, device=DEV, seed=seed)
    scale = float(p.kv_cache.float().nan_to_num(0).abs().max()) / 448
    kv = quantize_kv_fp8(p.kv_cache, scale)
    args = (p.q, kv, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref = mla_prefill(*args, kv_scale=_as_flashinfer_rounds(scale), backend="torch")
    out, lse = mla_prefill(*args, kv_scale=scale, backend="flashinfer")
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (128, 2)])
def test_flashinfer_decode_replayed_graph_follows_each_steps_lengths_and_pages(heads, q_len, seed):
    """Decode captured once into a CUDA graph under replayed_graph_capture(seqlens), as the runtime captures it,
    then replayed on other steps (other lengths up to 4096, other pages, other queries, NaN past every length)
    after the capture's replan: each replay equals the fp32 reference of its own step."""
    from pdlab.attention.ops import replayed_graph_capture

    rng = random.Random(seed)
    B = 24
    steps = [decode_problem(_lens(B, 4096, q_len, rng), heads, q_len, 64, torch.bfloat16, device=DEV, capacity=4096,
                            seed=seed + i) for i in range(4)]
    p = steps[0]
    q, kv, table, lens = (t.clone() for t in (p.q, p.kv_cache, p.block_table, p.seqlens))
    with replayed_graph_capture(lens.cpu()) as cap:
        mla_decode(q, kv, table, lens, p.softmax_scale, backend="flashinfer")  # warm-up: JIT, first plan
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = mla_decode(q, kv, table, lens, p.softmax_scale, backend="flashinfer")
    assert len(cap) == 1
    for s in steps[1:] + steps[:1]:
        for dst, src in zip((q, kv, table, lens), (s.q, s.kv_cache, s.block_table, s.seqlens)):
            dst.copy_(src)
        cap.replan(s.seqlens.cpu())
        graph.replay()
        ref = mla_decode(s.q, s.kv_cache, s.block_table, s.seqlens, s.softmax_scale, backend="torch")
        assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
            (s.seqlens.tolist()[:6], cosine_error(out, ref[0]), cosine_error(lse, ref[1]))
