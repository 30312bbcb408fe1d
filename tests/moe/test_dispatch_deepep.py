"""DeepEP adapter: argument translation checked against a fake `deep_ep` module that records every
call and implements the v1 Buffer semantics for rank 0 of a 2-rank world (only rank 0's own tokens
arrive), so the adapter's layouts and combine can be compared with a dense reference."""

import sys
import types

import pytest
import torch

from pdlab.kernels import nvfp4
from pdlab.moe.dispatch.base import payload_row_bytes
from pdlab.moe.dispatch.deepep import DeepEPDispatcher
from pdlab.moe.dispatch.selftest import global_tokens
from pdlab.moe.layouts import dequantize_hidden, quantize_fp8_blockwise, with_hidden

H, E, K, R = 256, 8, 3, 2
E_L = E // R
N_MAX = 16


class FakeBuffer:
    calls: list = []

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=False, num_qps_per_rank=1):
        FakeBuffer.calls.append(("Buffer", dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                               low_latency_mode=low_latency_mode, num_qps_per_rank=num_qps_per_rank)))

    @staticmethod
    def get_low_latency_rdma_size_hint(n_max, hidden, ranks, experts):
        return n_max * hidden * ranks * 1000

    # normal mode ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        FakeBuffer.calls.append(("get_dispatch_layout", dict(dtype=topk_idx.dtype, num_experts=num_experts)))
        in_rank = torch.zeros(topk_idx.shape[0], R, dtype=torch.bool)
        in_rank.scatter_(1, topk_idx // E_L, True)
        per_expert = torch.bincount(topk_idx.flatten(), minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, config=None):
        FakeBuffer.calls.append(("dispatch", dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights)))
        mine = is_token_in_rank[:, 0]
        recv_x = tuple(t[mine] for t in x) if isinstance(x, tuple) else x[mine]
        idx = topk_idx[mine]
        local = torch.where(idx < E_L, idx, torch.full_like(idx, -1))
        return recv_x, local, topk_weights[mine], [0] * E_L, (mine,), None

    def combine(self, x, handle, topk_weights=None, config=None):
        FakeBuffer.calls.append(("combine", dict(x=x)))
        mine, = handle
        out = torch.zeros(mine.shape[0], x.shape[1], dtype=x.dtype)
        out[mine] = x
        return out, None, None

    # low-latency mode ----------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False):
        FakeBuffer.calls.append(("low_latency_dispatch", dict(x=x, topk_idx=topk_idx, n_max=num_max_dispatch_tokens_per_rank,
                                                             num_experts=num_experts, use_fp8=use_fp8)))
        M = num_max_dispatch_tokens_per_rank * R
        slab = torch.zeros(E_L, M, x.shape[1], dtype=x.dtype)
        count = torch.zeros(E_L, dtype=torch.int32)
        where = {}
        for t in range(x.shape[0]):
            for j in range(topk_idx.shape[1]):
                e = int(topk_idx[t, j])
                if e < E_L:
                    slab[e, count[e]] = x[t]
                    where[(t, j)] = (e, int(count[e]))
                    count[e] += 1
        if use_fp8:  # scales M-major, as DeepEP allocates them: a transposed [E, K/128, M] buffer
            q, s = quantize_fp8_blockwise(slab)
            return (q, s.transpose(1, 2).contiguous().transpose(1, 2)), count, where, None, None
        return slab, count, where, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle):
        FakeBuffer.calls.append(("low_latency_combine", dict(x=x)))
        out = torch.zeros(topk_idx.shape[0], x.shape[2], dtype=torch.float32)
        for (t, j), (e, m) in handle.items():
            out[t] += topk_weights[t, j] * x[e, m].float()
        return out.to(torch.bfloat16), None, None


class FakeBufferNvfp4(FakeBuffer):
    """A DeepEP build with nvfp4 low-latency dispatch: K-major packed values, swizzled scales."""

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False, use_nvfp4=False, x_global_scale=None):
        slab, count, where, _, _ = super().low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                                num_experts, use_fp8=False)
        FakeBuffer.calls.append(("nvfp4", dict(use_nvfp4=use_nvfp4, x_global_scale=x_global_scale)))
        packed, sf = nvfp4.quantize_nvfp4(slab, x_global_scale.reshape(()))
        return (packed.transpose(1, 2), nvfp4.swizzle_scales_128x4(sf)), count, where, None, None


@pytest.fixture
def fake_deep_ep(monkeypatch):
    mod = types.ModuleType("deep_ep")
    mod.Buffer = FakeBuffer
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    FakeBuffer.calls = []
    return mod


def _reference(x, ids, w, deq=lambda t: t.float()):
    """Σ over rank 0's experts of w · x (identity experts)."""
    keep = (ids < E_L).float()
    return deq(x) * (w * keep).sum(1, keepdim=True)


def _inputs():
    x, ids, w = global_tokens(7, 1, 10, H, E, K, dtype=torch.bfloat16)
    return x, ids, w


def _make(mode, buffer_cls=None):
    buf = buffer_cls(None, 0, 0) if buffer_cls else None
    return DeepEPDispatcher(E, H, mode=mode, rank=0, world_size=R, num_max_dispatch_tokens_per_rank=N_MAX,
                            buffer=buf)


@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
def test_normal_mode_translation(fake_deep_ep, payload):
    x, ids, w = _inputs()
    d = _make("normal")
    assert FakeBuffer.calls[0][0] == "Buffer" and FakeBuffer.calls[0][1]["low_latency_mode"] is False
    gs = torch.tensor(448 * 6 / 5.0)
    layout, handle = d.dispatch(x, ids, w, payload, global_scale=gs)
    names = [c[0] for c in FakeBuffer.calls]
    assert names[-2:] == ["get_dispatch_layout", "dispatch"]
    assert FakeBuffer.calls[-2][1] == {"dtype": torch.int64, "num_experts": E}
    sent = FakeBuffer.calls[-1][1]["x"]
    if payload == "fp8":
        assert isinstance(sent, tuple) and sent[0].dtype == torch.float8_e4m3fn and sent[1].shape == (10, H // 128)
    elif payload == "nvfp4":  # opaque bytes: packed + scales per row, viewed as bf16
        assert sent.dtype == torch.bfloat16 and sent.shape == (10, (H // 2 + H // 16) // 2)
    else:
        assert sent is x
    assert layout.kind == "contiguous" and layout.payload == payload and layout.num_experts == E_L
    out = d.combine(with_hidden(layout, dequantize_hidden(layout, torch.bfloat16)), handle)
    assert FakeBuffer.calls[-1][0] == "combine" and FakeBuffer.calls[-1][1]["x"].dtype == torch.bfloat16
    ref = _reference(x, ids, w)
    tol = {"bf16": 2e-2, "fp8": 8e-2, "nvfp4": 0.3}[payload]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_low_latency_translation(fake_deep_ep, payload):
    x, ids, w = _inputs()
    d = _make("low_latency")
    buf_call = FakeBuffer.calls[0][1]
    assert buf_call["low_latency_mode"] is True and buf_call["num_qps_per_rank"] == E_L
    assert buf_call["num_rdma_bytes"] == N_MAX * H * R * 1000  # sized from DeepEP's own hint
    tokens = d.quantize(x, payload)
    assert tokens.deferred is (payload == "fp8") and tokens.row_bytes() == payload_row_bytes(payload, H)
    if payload == "fp8":  # DeepEP quantizes inside its kernel; other backends refuse such a payload
        from pdlab.moe.dispatch import create_dispatcher
        with pytest.raises(ValueError, match="deferred"):
            create_dispatcher("local", E, H).dispatch(tokens, ids, w, payload)
    layout, handle = d.dispatch(tokens, ids, w, payload)
    call = FakeBuffer.calls[-1][1]
    assert call["x"].dtype == torch.bfloat16 and call["topk_idx"].dtype == torch.int64
    assert call["n_max"] == N_MAX and call["num_experts"] == E and call["use_fp8"] is (payload == "fp8")
    assert layout.kind == "masked" and layout.hidden.shape[:2] == (E_L, N_MAX * R)
    assert layout.masked_m.dtype == torch.int32
    if payload == "fp8":
        assert layout.scales.stride(-1) == 1  # K-major for the experts' kernels
    out = d.combine(with_hidden(layout, dequantize_hidden(layout, torch.bfloat16)), handle)
    ref = _reference(x, ids, w)
    tol = 2e-2 if payload == "bf16" else 8e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_low_latency_nvfp4_is_feature_detected(fake_deep_ep):
    x, ids, w = _inputs()
    gs = torch.tensor(448 * 6 / 5.0)
    plain = _make("low_latency")
    assert plain.supports("nvfp4", "low_latency") and "fp8" in plain.supports("nvfp4", "low_latency")
    with pytest.raises(ValueError, match="no nvfp4 low-latency dispatch"):
        plain.dispatch(x, ids, w, "nvfp4", global_scale=gs)
    d = _make("low_latency", FakeBufferNvfp4)
    assert d.supports("nvfp4", "low_latency") is None
    layout, handle = d.dispatch(x, ids, w, "nvfp4", global_scale=gs)
    assert [c for c in FakeBuffer.calls if c[0] == "nvfp4"][-1][1]["use_nvfp4"] is True
    assert layout.payload == "nvfp4" and layout.hidden.shape == (E_L, N_MAX * R, H // 2)
    assert layout.scales.shape == (E_L, N_MAX * R, H // 16) and layout.scales.dtype == torch.float8_e4m3fn
    out = d.combine(with_hidden(layout, dequantize_hidden(layout, torch.bfloat16)), handle)
    ref = _reference(x, ids, w)
    torch.testing.assert_close(out.float(), ref, rtol=0.3, atol=0.3 * float(ref.abs().max()))


def test_one_buffer_serves_one_mode(fake_deep_ep):
    x, ids, w = _inputs()
    d = _make("normal")
    with pytest.raises(ValueError, match="second deepep dispatcher"):
        d.dispatch(x, ids, w, "bf16", mode="low_latency")
