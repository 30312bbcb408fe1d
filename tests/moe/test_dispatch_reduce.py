"""gather_reduce (the combine arithmetic): the Triton kernel equals the torch path — under the
Triton interpreter on CPU (fp32/fp16, in a subprocess so TRITON_INTERPRET is set before triton is
imported) and natively on GPU (bf16)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pdlab.moe.dispatch._reduce import gather_reduce


def _case(N=37, M=23, J=5, H=200, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(N, H, generator=g).to(dtype).to(device)
    index = torch.randint(-1, N, (M, J), generator=g).to(device)
    index[0] = -1  # a row with nothing to sum
    w = torch.rand(M, J, generator=g).to(device)
    return src, index, w


def test_torch_path_against_a_loop():
    src, index, w = _case()
    out = gather_reduce(src, index, w, torch.float32, impl="torch", chunk_rows=7)
    ref = torch.zeros_like(out)
    for m in range(index.shape[0]):
        for j in range(index.shape[1]):
            if index[m, j] >= 0:
                ref[m] += w[m, j] * src[index[m, j]]
    torch.testing.assert_close(out, ref)
    assert out[0].abs().sum() == 0
    unweighted = gather_reduce(src, index, None, torch.float32, impl="torch")
    torch.testing.assert_close(unweighted, gather_reduce(src, index, torch.ones_like(w), torch.float32, impl="torch"))


def test_triton_kernel_under_the_interpreter():
    code = textwrap.dedent("""
        import torch
        from pdlab.moe.dispatch._reduce import gather_reduce
        g = torch.Generator().manual_seed(1)
        for dtype, H in ((torch.float32, 200), (torch.float16, 1100)):
            src = torch.randn(29, H, generator=g).to(dtype)
            index = torch.randint(-1, 29, (11, 4), generator=g)
            w = torch.rand(11, 4, generator=g)
            for weights in (w, None):
                a = gather_reduce(src, index, weights, torch.float32, impl="triton")
                b = gather_reduce(src, index, weights, torch.float32, impl="torch")
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
def test_triton_kernel_on_gpu_bf16():
    src, index, w = _case(N=5000, M=4096, J=8, H=7168, dtype=torch.bfloat16, device="cuda")
    a = gather_reduce(src, index, w, torch.bfloat16, impl="triton")
    b = gather_reduce(src, index, w, torch.bfloat16, impl="torch")
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
