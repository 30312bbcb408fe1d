"""The mla_decode tuning target's edge inputs: the served shapes every stored winner must also get right."""

import dataclasses

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


def test_sm90_gluon_buckets_search_the_kernel_and_the_knobs_it_reads():
    # where a Gluon kernel runs by default on sm90 (with a Triton that has Gluon) the search is the kernel and the
    # split knobs it reads: fp8 with heads × q_len ≤ 32, and bf16 or fp8 in programs of 64 rows (128 heads, 16 heads ×
    # S_q 4); elsewhere (16 heads bf16, 48 heads, other archs) the whole triton space but the kernel knob
    from pdlab.attention import gluon_mla
    from pdlab.kernels import registry
    from pdlab.tuning.attention import MLA_DECODE

    triton = registry.get_backend("mla_decode", "triton")
    rest = {k: v for k, v in triton.config_space.items() if k not in ("kernel", "schedule", "seesaw")}  # _mla_fwd
    b = {"batch": 128, "seqlen": 8192, "heads": 16, "kv_dtype": "fp8", "q_len": 1}
    wide = [{**b, "heads": 128, "kv_dtype": "bf16"}, {**b, "kv_dtype": "bf16", "q_len": 4}, {**b, "heads": 128},
            {**b, "q_len": 4}]
    for other in ({**b, "kv_dtype": "bf16"}, {**b, "heads": 48}):
        assert MLA_DECODE.search_space(triton, other, "sm90") == rest
    for other in [b] + wide:
        assert MLA_DECODE.search_space(triton, other, "sm100") == rest
    if not gluon_mla.HAVE_GLUON:
        assert MLA_DECODE.search_space(triton, b, "sm90") == rest
        return
    space = MLA_DECODE.search_space(triton, {**b, "batch": 8}, "sm90")
    assert set(space) == {"kernel", "num_splits", "waves"} and space["kernel"] == ["triton", "gluon"]
    assert MLA_DECODE.search_space(triton, {**b, "batch": 8, "q_len": 2}, "sm90") == space
    for other in wide:  # 64-row programs (16-bit or fp8 pools): the schedule (seesaw) too
        assert MLA_DECODE.search_space(triton, other, "sm90") == {**space, "seesaw": [1, 0]}
    # from BALANCED_MIN_BATCH sequences the fp8 kernel's balanced schedule picks its splits: the kernel only
    assert MLA_DECODE.search_space(triton, b, "sm90") == {"kernel": space["kernel"]}


def test_prefill_search_drops_knobs_the_bucket_never_reads():
    # over a bf16 cache the triton prefill never reads fp8_compute or fp8_dequant, and with every num_splits value
    # explicit it never reads waves: searching them only repeats configs; nor a BLOCK_H past the bucket's heads
    from pdlab.kernels import registry
    from pdlab.tuning.attention import MLA_PREFILL
    from pdlab.tuning.target import space_size

    triton = registry.get_backend("mla_prefill", "triton")
    b = {"batch": 8, "q_len": 2048, "seqlen": 6144, "heads": 128, "kv_dtype": "bf16"}
    space = MLA_PREFILL.search_space(triton, b, "sm90")
    assert set(triton.config_space) - set(space) == {"fp8_compute", "fp8_dequant"} and space["waves"] == [1.0, 2.0]
    assert space_size(space) * 4 == space_size(triton.config_space)
    assert {"fp8_compute", "fp8_dequant"} <= set(MLA_PREFILL.search_space(triton, {**b, "kv_dtype": "fp8"}, "sm90"))
    explicit = dataclasses.replace(triton, config_space={**triton.config_space, "num_splits": [1, 2, 4]})
    assert "waves" not in MLA_PREFILL.search_space(explicit, b, "sm90")  # every split count explicit
    # 16 heads: BLOCK_H 16, 32 and 64 are one launch (a program never holds more heads than there are)
    h16 = MLA_PREFILL.search_space(triton, {**b, "heads": 16}, "sm90")
    assert h16["BLOCK_H"] == [16] and space["BLOCK_H"] == [16, 32, 64]
    assert MLA_PREFILL.search_space(triton, {**b, "heads": 8}, "sm90")["BLOCK_H"] == [16]
    torch_backend = registry.get_backend("mla_prefill", "torch")
    assert MLA_PREFILL.search_space(torch_backend, b, "sm90") == dict(torch_backend.config_space)
