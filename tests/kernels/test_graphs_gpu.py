"""GPU: a CUDA-graph capture that fails inside (a host sync) leaves the process usable: the caller's stream is
current again, random ops work, and the next capture and replay give the eager result."""

import pytest
import torch

from pdlab.kernels.graphs import capture_graph

pytestmark = pytest.mark.gpu


def _capture_with_a_host_sync():
    x = torch.ones(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError):
        with capture_graph(g, stream=side):
            (x * 2).sum().item()  # copies to the host: forbidden while capturing, the capture is invalidated


def test_a_failed_capture_restores_the_stream_and_random_ops():
    before = torch.cuda.current_stream()
    _capture_with_a_host_sync()
    assert torch.cuda.current_stream() == before
    assert not torch.cuda.is_current_stream_capturing()
    r = torch.rand(1024, device="cuda")  # without the reset: "Offset increment outside graph capture"
    assert 0.4 < float(r.mean()) < 0.6


def test_a_capture_after_a_failed_one_replays_random_ops_and_arithmetic():
    _capture_with_a_host_sync()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = torch.empty(8, device="cuda")
    noise = torch.empty(8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with capture_graph(g, stream=side):
        out.copy_(x * 3 + 1)
        noise.copy_(torch.rand(8, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    x.add_(1)
    g.replay()
    first = noise.clone()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (torch.arange(8, device="cuda") + 1) * 3.0 + 1)
    assert not torch.equal(first, noise)  # each replay draws new numbers: the generator's graph state is live
