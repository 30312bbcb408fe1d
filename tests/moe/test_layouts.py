"""Dispatch layouts: contracts, group_tokens / to_masked / to_contiguous against hand-computed answers."""

import pytest
import torch

from pdlab.kernels.contracts import ShapeError
from pdlab.moe.layouts import (Contiguous, Masked, dequantize_hidden, group_tokens, quantize_payload, to_contiguous,
                               to_masked)


def test_group_tokens_hand_computed():
    x = torch.arange(4 * 2, dtype=torch.float32).view(4, 2)  # token t = [2t, 2t+1]
    ids = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 0]], dtype=torch.int32)
    layout, info = group_tokens(x, ids, 4)
    assert layout.counts.tolist() == [3, 1, 3, 1]
    assert layout.offsets.tolist() == [0, 3, 4, 7, 8]
    # expert 0: (t0,s1), (t3,s0), (t3,s1); expert 1: (t1,s0); expert 2: (t0,s0), (t1,s1), (t2,s0); expert 3: (t2,s1)
    assert info.src_token.tolist() == [0, 3, 3, 1, 0, 1, 2, 2]
    assert info.src_slot.tolist() == [1, 0, 1, 0, 0, 1, 0, 1]
    assert torch.equal(layout.hidden, x[info.src_token])
    assert info.row_of.tolist() == [[4, 0], [3, 5], [6, 7], [1, 2]]
    assert layout.validate() == {"N": 8, "K": 2, "E": 4, "E1": 5}


def test_group_tokens_local_expert_range_drops_remote():
    x = torch.randn(3, 16)
    ids = torch.tensor([[0, 5], [6, 7], [4, 1]])
    layout, info = group_tokens(x, ids, 4, expert_start=4)  # local experts 4..7
    assert layout.counts.tolist() == [1, 1, 1, 1]
    assert info.row_of.tolist() == [[-1, 1], [2, 3], [0, -1]]


@pytest.mark.parametrize("start", [0, 4])
def test_group_tokens_with_host_known_rows_matches_the_read_back(start):
    """num_rows = T·k (no host sync): the local rows, counts, offsets and row_of are those of the read-back layout;
    the rows past offsets[E] are the dropped pairs' padding, with row_of -1. Start 0: every id is local; start 4:
    ids 0..3 are another rank's, dropped."""
    torch.manual_seed(0)
    x = torch.randn(9, 16)
    ids = torch.randint(0, 4 + start, (9, 3))
    exact, info = group_tokens(x, ids, 4, expert_start=start)
    padded, pinfo = group_tokens(x, ids, 4, expert_start=start, num_rows=27)
    n = int(exact.offsets[-1])
    assert padded.hidden.shape == (27, 16) and exact.hidden.shape == (n, 16)
    assert torch.equal(padded.counts, exact.counts) and torch.equal(padded.offsets, exact.offsets)
    assert torch.equal(padded.hidden[:n], exact.hidden) and torch.equal(pinfo.src_token[:n], info.src_token)
    assert torch.equal(pinfo.row_of, info.row_of)
    assert (pinfo.row_of >= 0).sum() == n and (n < 27) == (start == 4)
    padded.check_rows()
    with pytest.raises(ValueError, match="num_rows=28 must lie in 0..T·k=27"):
        group_tokens(x, ids, 4, expert_start=start, num_rows=28)


def test_to_masked_roundtrip_and_fill():
    x = torch.randn(6, 32)
    ids = torch.randint(0, 5, (6, 3))
    layout, _ = group_tokens(x, ids, 5)
    masked = to_masked(layout, fill=float("nan"))
    assert masked.hidden.shape == (5, int(layout.counts.max()), 32)
    assert masked.max_rows == int(layout.counts.sum()) == 18  # the exact row count bounds the slab
    assert masked.validate()["E"] == 5
    for e in range(5):
        m = int(layout.counts[e])
        o = int(layout.offsets[e])
        assert torch.equal(masked.hidden[e, :m], layout.hidden[o:o + m])
        assert torch.isnan(masked.hidden[e, m:]).all()
    back = to_contiguous(masked)
    assert torch.equal(back.hidden, layout.hidden) and torch.equal(back.offsets, layout.offsets)
    with pytest.raises(ValueError, match="max_m"):
        to_masked(layout, max_m=int(layout.counts.max()) - 1)


@pytest.mark.parametrize("payload", ["fp8", "nvfp4"])
def test_quantized_payloads_travel_with_rows(payload):
    x = torch.randn(5, 256)
    ids = torch.randint(0, 3, (5, 2))
    hidden, scales, gs = quantize_payload(x, payload)
    layout, info = group_tokens(hidden, ids, 3, scales=scales, global_scale=gs)
    assert layout.payload == payload and layout.hidden_size == 256
    layout.validate()
    deq = dequantize_hidden(layout)
    err = (deq - x[info.src_token]).norm() / x[info.src_token].norm()
    assert err < (0.04 if payload == "fp8" else 0.15)
    masked = to_masked(layout)
    masked.validate()
    assert masked.scales.shape[:2] == masked.hidden.shape[:2]


def test_masked_validate_rejects_2d_with_hint():
    with pytest.raises(ShapeError, match=r"2 dims instead of 3.*normal-mode dispatch"):
        Masked(torch.randn(10, 64), torch.zeros(4, dtype=torch.int32)).validate()
    with pytest.raises(ShapeError, match=r"3 dims instead of 2.*low-latency dispatch"):
        Contiguous(torch.randn(4, 3, 64), torch.zeros(4, dtype=torch.int32),
                   torch.zeros(5, dtype=torch.int32)).validate()


def test_contract_violations_name_the_argument():
    h = torch.randn(8, 64)
    counts = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ShapeError, match="'offsets'.*E\\+1"):
        Contiguous(h, counts, torch.zeros(4, dtype=torch.int32)).validate()
    with pytest.raises(ShapeError, match="'counts'.*wrong dtype"):
        Contiguous(h, counts.long(), torch.zeros(5, dtype=torch.int32)).validate()
    packed = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(ShapeError, match="'scales'"):
        Contiguous(packed, counts, torch.zeros(5, dtype=torch.int32), "nvfp4",
                   torch.zeros(8, 8, dtype=torch.float8_e4m3fn), torch.tensor(1.0)).validate()
    with pytest.raises(ShapeError, match="'global_scale'"):
        Contiguous(packed, counts, torch.zeros(5, dtype=torch.int32), "nvfp4",
                   torch.zeros(8, 4, dtype=torch.float8_e4m3fn), torch.ones(3)).validate()
    with pytest.raises(ShapeError, match="payload 'bf16'"):
        Contiguous(packed, counts, torch.zeros(5, dtype=torch.int32)).validate()


def test_check_rows_accepts_what_the_builders_make():
    x = torch.randn(7, 16)
    ids = torch.tensor([[0, 2], [2, 1], [2, 0], [2, 3], [2, 0], [1, 3], [2, 1]])
    layout, _ = group_tokens(x, ids, 5)  # expert 4 gets no row
    layout.check_rows()
    masked = to_masked(layout)
    assert masked.max_rows == 14 and masked.hidden.shape[1] == 6
    masked.check_rows()
    Masked(masked.hidden, masked.masked_m).check_rows()  # unbounded


def test_check_rows_names_the_first_bad_expert():
    h = torch.randn(3, 4, 16)
    with pytest.raises(ShapeError, match=r"'masked_m' counts rows the slab does not have.*<= 4.*masked_m\[1\] = 5"):
        Masked(h, torch.tensor([4, 5, 0], dtype=torch.int32)).check_rows("moe_experts", "triton")
    with pytest.raises(ShapeError, match=r"masked_m\[2\] = -1"):
        Masked(h, torch.tensor([0, 0, -1], dtype=torch.int32)).check_rows()
    # within the slab, but more rows than the producer's bound: kernels sized by max_rows would skip the rest
    with pytest.raises(ShapeError, match=r"sums above the layout's max_rows.*max_rows = 6.*sum\(masked_m\) = 7"):
        Masked(h, torch.tensor([4, 3, 0], dtype=torch.int32), max_rows=6).check_rows()
    Masked(h, torch.tensor([4, 2, 0], dtype=torch.int32), max_rows=6).check_rows()
    rows = torch.randn(5, 16)
    with pytest.raises(ShapeError, match=r"'offsets' does not accumulate counts.*counts\[1\] = 2, offsets\[1:3\] = "
                                         r"\[1, 4\]"):
        Contiguous(rows, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 4], dtype=torch.int32)
                   ).check_rows()
    with pytest.raises(ShapeError, match=r"counts\[0\] = -1"):
        Contiguous(rows, torch.tensor([-1, 2], dtype=torch.int32), torch.tensor([0, -1, 1], dtype=torch.int32)
                   ).check_rows()
    with pytest.raises(ShapeError, match=r"offsets\[0:2\] = \[2, 3\]"):
        Contiguous(rows, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([2, 3, 5], dtype=torch.int32)
                   ).check_rows()
    with pytest.raises(ShapeError, match=r"'offsets'.*E\+1"):  # the shapes first: no bare IndexError
        Contiguous(rows, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)).check_rows()
    with pytest.raises(ShapeError, match="2 dims instead of 3"):
        Masked(rows, torch.tensor([1, 2], dtype=torch.int32)).check_rows()
    with pytest.raises(ShapeError, match=r"'counts' holds more rows than hidden.*<= 5.*= 6"):
        Contiguous(rows, torch.tensor([4, 2], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32)
                   ).check_rows()
