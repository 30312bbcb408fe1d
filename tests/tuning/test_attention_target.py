"""The mla_decode tuning target's edge inputs: the served shapes every stored winner must also get right."""

import pytest
import torch

from pdlab.attention import mla_decode
from pdlab.tuning.attention import EDGE_LENS, MLA_DECODE, decode_edge_inputs
from pdlab.tuning.models import DEEPSEEK_R1


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_edge_inputs_are_ragged_with_poison_past_each_length(kv_dtype):
    bucket = {"batch": 128, "seqlen": 8192, "heads": 16, "kv_dtype": kv_dtype, "q_len": 1}
    cases = decode_edge_inputs(bucket, DEEPSEEK_R1, torch.device("cpu"))
    assert [x.seqlens.tolist() for x in cases] == [list(lens) for lens in EDGE_LENS]
    for x in cases:
        assert x.block_table.shape[1] * 64 == 512 and x.q.shape[2] == 16
        for b, n in enumerate(x.seqlens.tolist()):
            rows = x.kv_cache[x.block_table[b].long()].reshape(512, -1)
            vals = rows.view(torch.float8_e4m3fn).float() if kv_dtype == "fp8" else rows.float()
            assert torch.isfinite(vals[:n]).all() and torch.isnan(vals[n:]).all()
        # the reference reads no row past a length: finite, and what the tuner compares every winner with
        out, lse = MLA_DECODE.call("torch", None, x)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        # a kernel that read one row too many would be caught: NaN reaches the output
        longer = x.seqlens + 1
        bad, _ = mla_decode(x.q, x.kv_cache, x.block_table, longer.clamp(max=512), x.softmax_scale, kv_scale=x.kv_scale,
                            backend="torch")
        assert torch.isnan(bad).any()


def test_sm90_fp8_small_head_buckets_search_the_gluon_kernel_and_its_splits():
    # where the Gluon fp8 kernel runs by default (sm90, heads × q_len ≤ 32, a Triton with Gluon) the search is the
    # kernel and the split knobs; elsewhere (bf16, 128 heads, other archs) the whole triton space
    from pdlab.attention import gluon_mla
    from pdlab.kernels import registry
    from pdlab.tuning.attention import MLA_DECODE

    triton = registry.get_backend("mla_decode", "triton")
    rest = {k: v for k, v in triton.config_space.items() if k != "kernel"}  # where only _mla_fwd can run
    b = {"batch": 128, "seqlen": 8192, "heads": 16, "kv_dtype": "fp8", "q_len": 1}
    for other in ({**b, "kv_dtype": "bf16"}, {**b, "heads": 128}, {**b, "q_len": 4}):
        assert MLA_DECODE.search_space(triton, other, "sm90") == rest
    assert MLA_DECODE.search_space(triton, b, "sm100") == rest
    if not gluon_mla.HAVE_GLUON:
        assert MLA_DECODE.search_space(triton, b, "sm90") == rest
        return
    space = MLA_DECODE.search_space(triton, b, "sm90")
    assert set(space) == {"kernel", "num_splits", "waves"} and space["kernel"] == ["triton", "gluon"]
    assert MLA_DECODE.search_space(triton, {**b, "q_len": 2}, "sm90") == space
