"""MLA ops and fp8 KV helpers on bad input: a max_q_len below a sequence's new tokens, fp8 scales that cannot
quantize, slots below -1."""

import pytest
import torch

from pdlab.attention import mla_prefill
from pdlab.attention.workloads import prefill_problem
from pdlab.kernels import registry
from pdlab.kernels.contracts import ShapeError

TRITON_PREFILL = registry.get_backend("mla_prefill", "triton")


def _prefill(p, backend, **kw):
    return mla_prefill(p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["torch", TRITON_PREFILL])
def test_prefill_max_q_len_below_a_sequences_new_tokens_is_named(backend):
    """max_q_len sizes the triton launch grid: one below a sequence's new tokens left that sequence's last rows
    unwritten (garbage out, nothing said). With qo_indptr on the host the op checks it for free."""
    p = prefill_problem([5, 9, 3], [3, 9, 1], heads=2, page=4, dtype=torch.float32, seed=0)
    with pytest.raises(ShapeError, match=r"max_q_len.*sequence 1 adds 9 new tokens.*max_q_len >= 9"):
        _prefill(p, backend, max_q_len=3)


def test_prefill_max_q_len_at_the_longest_sequence_matches_the_reference():
    p = prefill_problem([5, 9, 3], [3, 9, 1], heads=2, page=4, dtype=torch.float32, seed=0)
    ref_out, ref_lse = _prefill(p, "torch")
    out, lse = _prefill(p, TRITON_PREFILL, max_q_len=9, config={})
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), True])
@pytest.mark.parametrize("fn", ["quantize", "dequantize"])
def test_fp8_helpers_name_a_host_scale_that_cannot_scale(fn, bad):
    """A scale of 0 saturated every byte to ±448 (quantize) or zeroed every value (dequantize); a negative one
    flipped the signs; NaN gave NaN bytes: all silently."""
    from pdlab.attention import dequantize_kv_fp8, quantize_kv_fp8

    x = torch.ones(2, 576)
    with pytest.raises(ValueError, match=r"kv_scale.*finite number > 0"):
        quantize_kv_fp8(x, bad) if fn == "quantize" else dequantize_kv_fp8(quantize_kv_fp8(x, 1.0), bad)


@pytest.mark.parametrize("fn", ["quantize", "dequantize"])
def test_fp8_helpers_name_a_scale_tensor_of_several_values(fn):
    from pdlab.attention import dequantize_kv_fp8, quantize_kv_fp8

    x = torch.ones(2, 576)
    with pytest.raises(ValueError, match=r"kv_scale.*1 element.*got \[2\]"):
        quantize_kv_fp8(x, torch.ones(2)) if fn == "quantize" else dequantize_kv_fp8(quantize_kv_fp8(x, 1.0),
                                                                                      torch.ones(2))


def test_fp8_helpers_take_a_number_or_a_one_element_tensor():
    from pdlab.attention import dequantize_kv_fp8, quantize_kv_fp8

    x = torch.full((2, 576), 3.0)
    for scale in (0.5, torch.tensor(0.5), torch.tensor([0.5])):
        torch.testing.assert_close(dequantize_kv_fp8(quantize_kv_fp8(x, scale), scale), x)


@pytest.mark.parametrize("bad", [-2, -100])
def test_reference_store_names_a_slot_below_minus_one(bad):
    """-1 is the one skip marker; the torch backend raises for every other slot outside the pool, as documented
    (it skipped any negative slot, so a miscomputed slot lost its row silently)."""
    from pdlab.attention import store_kv

    kv = torch.zeros(3, 4, 576)
    with pytest.raises(ShapeError, match=rf"slots.*slot {bad}.*-1 skips"):
        store_kv(kv, torch.tensor([0, bad]), torch.randn(2, 576), backend="torch")
    store_kv(kv, torch.tensor([0, -1]), torch.ones(2, 576), backend="torch")  # -1 still skips
    assert kv.view(-1, 576)[0].eq(1).all() and kv.view(-1, 576)[1:].eq(0).all()


@pytest.mark.parametrize("bad", ["x", -1, 2.5, True])
def test_decode_max_seqlen_that_is_no_length_is_named(bad):
    # max_seqlen="x" ended in int()'s bare ValueError; -1 was read as a bound every sequence breaks
    from pdlab.attention import mla_decode
    from pdlab.attention.workloads import decode_problem

    p = decode_problem([5, 9], heads=2, page=4, dtype=torch.float32, seed=0)
    with pytest.raises(ShapeError, match=r"max_seqlen.*an int >= 0 or None"):
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, backend="torch", max_seqlen=bad)
    out, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, backend="torch", max_seqlen=9)
    assert torch.isfinite(out).all()
