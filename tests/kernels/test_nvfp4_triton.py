"""Triton NVFP4 quantize kernel vs the torch reference, bit for bit.

CPU: under the Triton interpreter at tiny shapes, in a subprocess (TRITON_INTERPRET=1 must be set
before triton is first imported, which this pytest process may already have done).
GPU (@gpu): the same checks compiled, plus DeepSeek shapes."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES_FILE = Path(__file__).with_name("nvfp4_triton_cases.py")


def _cases():
    spec = importlib.util.spec_from_file_location("nvfp4_triton_cases", CASES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["roundings", "small", "masked", "nonfinite", "empty"])
def test_triton_matches_reference_in_interpreter(case):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(CASES_FILE), case], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(CASES_FILE.parent))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"{case}: ok" in proc.stdout


def test_triton_backend_reports_why_not_on_plain_cpu():
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton is usable here")
    from pdlab.kernels import nvfp4, registry

    reason = registry.unavailable_reason("nvfp4_quantize", "triton")
    assert "TRITON_INTERPRET=1" in reason
    with pytest.raises(RuntimeError, match="'triton' is unavailable.*Usable here: torch"):
        nvfp4.quantize(torch.zeros(2, 32), 1.0, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["roundings", "small", "masked", "nonfinite", "empty"])
def test_triton_matches_reference_on_gpu_small(case):
    _cases().CASES[case]("cuda")


@pytest.mark.gpu
def test_triton_bit_exact_at_deepseek_shapes():
    from pdlab.kernels import nvfp4

    cases = _cases()
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in [(1, 7168), (4096, 7168), (16384, 2048), (333, 7168)]:
        x = torch.randn(m, k, generator=g, device="cuda") * torch.exp(2 * torch.randn(k, generator=g, device="cuda"))
        x = x.to(torch.bfloat16)
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax()).reshape(1)
        cases.compare(x, gs, what="deepseek")
        cases.compare(x, gs, swizzle=True, what="deepseek swizzled")
    e, m_max, k = 32, 256, 7168
    x = torch.randn(e, m_max, k, generator=g, device="cuda").to(torch.bfloat16)
    masked_m = torch.randint(0, m_max + 1, (e,), generator=g, device="cuda", dtype=torch.int32)
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax(dim=(1, 2)))
    cases.compare(x, gs, masked_m, what="low-latency masked")
    cases.compare(x, gs, masked_m, swizzle=True, what="low-latency masked swizzled")
    # the output is what an sm100 grouped GEMM reads: unswizzling gives the row-major scales back
    _, s = nvfp4.quantize(x, gs, masked_m, swizzle=True, backend="triton")
    _, s_ref = nvfp4.quantize_nvfp4(x, gs, masked_m)
    assert torch.equal(nvfp4.unswizzle_scales_128x4(s.view(torch.uint8), m_max, k // 16), s_ref.view(torch.uint8))


@pytest.mark.gpu
def test_triton_is_default_on_gpu_and_graph_capturable():
    from pdlab.kernels import nvfp4, registry

    assert registry.select("nvfp4_quantize", device="cuda").name == "triton"
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor([10.0], device="cuda")
    p0, s0 = nvfp4.quantize(x, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p1, s1 = nvfp4.quantize(x, gs)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    p2, s2 = nvfp4.quantize_nvfp4(x, gs)
    assert torch.equal(p1, p2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))
    assert not torch.equal(p0, p2)
