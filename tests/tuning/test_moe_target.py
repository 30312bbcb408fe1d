"""The MoE tuning target's weight builder: chunked quantization equals the stacked one."""

import torch

from pdlab.moe.weights import NVFP4_KEYS, ExpertWeights
from pdlab.tuning.moe import quantize_in_chunks


def test_chunked_quantization_equals_stacked():
    g = torch.Generator().manual_seed(3)
    E, I, H = 5, 32, 64
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    w13[2] *= 40.0  # experts with very different ranges: per-expert scale_2 must survive chunking
    w2[4] *= 1e-3
    whole = ExpertWeights.from_bf16(w13, w2, quantize=True, keep_bf16=False)
    chunked = quantize_in_chunks(lambda e0, n: (w13[e0:e0 + n], w2[e0:e0 + n]), E, chunk=2)
    for k in NVFP4_KEYS:
        a, b = getattr(whole, k), getattr(chunked, k)
        assert a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k
