"""MLA ops on bad and unusual input: page ids outside the pool, strided tensors, empty batches."""

import pytest
import torch

from pdlab.attention import mla_decode, mla_prefill
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.kernels.contracts import ShapeError


def _decode(p, **kw):
    args = dict(block_table=p.block_table, seqlens=p.seqlens)
    args.update(kw)
    return mla_decode(p.q, p.kv_cache, args["block_table"], args["seqlens"], p.softmax_scale, kv_scale=p.kv_scale,
                      backend="torch")


def _prefill(p, block_table):
    return mla_prefill(p.q, p.kv_cache, block_table, p.seqlens, p.qo_indptr, p.softmax_scale, kv_scale=p.kv_scale,
                       backend="torch")


@pytest.mark.parametrize("bad", [-1, 1000])
def test_reference_decode_names_a_page_id_outside_the_pool(bad):
    p = decode_problem([5, 17], heads=2, page=4, dtype=torch.float32, seed=0)
    table = p.block_table.clone()
    table[1, 2] = bad  # sequence 1 reads its first 5 pages
    with pytest.raises(ShapeError, match=r"block_table.*sequence 1.*0 <= page id < 13"):
        _decode(p, block_table=table)


@pytest.mark.parametrize("bad", [-1, 1000])
def test_reference_prefill_names_a_page_id_outside_the_pool(bad):
    p = prefill_problem([5, 9], [3, 4], heads=2, page=4, dtype=torch.float32, seed=0)
    table = p.block_table.clone()
    table[0, 0] = bad
    with pytest.raises(ShapeError, match=r"block_table.*sequence 0"):
        _prefill(p, table)


def test_reference_ignores_entries_past_a_sequences_pages():
    # -1 padding after the pages a sequence reads is the usual table layout: accepted, same answer
    p = decode_problem([5, 17], heads=2, page=4, dtype=torch.float32, seed=0)
    ref_out, ref_lse = _decode(p)
    table = p.block_table.clone()
    table[0, 2:] = -1  # sequence 0 (5 tokens) reads pages 0 and 1 only
    out, lse = _decode(p, block_table=table)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_a_host_kv_scale_that_cannot_dequantize_is_named(bad):
    """A Python kv_scale is known on the host, so 0, negative, NaN, Inf, or not a number is refused for free (it
    would scale every cached row to 0, NaN or Inf)."""
    p = decode_problem([5, 17], heads=2, page=4, dtype=torch.float32, kv_dtype="fp8", seed=0)
    with pytest.raises(ShapeError, match=r"kv_scale.*a finite number > 0"):
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=bad, backend="torch")
    out, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                        backend="torch")
    assert torch.isfinite(out).all()
