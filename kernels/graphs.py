"""CUDA-graph capture that leaves the process usable when it fails.

`torch.cuda.graph` ends a capture in its exit. When the capture was invalidated inside (a host sync, an
allocation another thread made in global capture mode, any call a capture forbids), ending it raises, and the
exit stops there: the capture stream stays the current stream, and the device's CUDA generator still counts as
capturing. Every later random op on that device then fails with "Offset increment outside graph capture
encountered unexpectedly", far from the capture that caused it. Callers that fall back to eager work after a
failed capture (the runtime's decode graphs, the bench harness's graph timing, the tuner's trials) capture
through `capture_graph` instead.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

log = logging.getLogger("pdlab.kernels")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (no host sync, no host read of device values)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def capture_graph(graph: "torch.cuda.CUDAGraph", *, stream: "torch.cuda.Stream | None" = None,
                  pool=None) -> Iterator["torch.cuda.CUDAGraph"]:
    """`torch.cuda.graph(graph, pool=pool, stream=stream)`; when the capture raises, the caller's stream is made
    current again and the CUDA generator is reset (`reset_after_failed_capture`) before the error propagates."""
    caller = torch.cuda.current_stream(stream.device if stream is not None else None)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield graph
    except BaseException:
        reset_after_failed_capture(caller)
        raise


def reset_after_failed_capture(stream: "torch.cuda.Stream") -> None:
    """Make `stream` the current stream of its device again and capture one graph of one small kernel there on a
    fresh side stream: a capture that ends cleanly resets the device's CUDA generator. A failure here is logged,
    not raised: the first capture's error is the one to report (the device may hold a sticky error by now)."""
    torch.cuda.set_stream(stream)
    try:
        x = torch.zeros(1, device=stream.device)
        side = torch.cuda.Stream(stream.device)
        side.wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            x.add_(1)
        stream.wait_stream(side)
        del g
    except Exception as exc:
        log.warning("could not reset the CUDA generator after a failed graph capture (%s: %s)",
                    type(exc).__name__, exc)
