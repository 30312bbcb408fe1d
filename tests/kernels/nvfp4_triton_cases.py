"""Checks of the Triton NVFP4 kernel against the torch reference, shared by the CPU tests (run in a
subprocess under TRITON_INTERPRET=1, which must be set before triton is imported) and the GPU tests.

Run directly: `TRITON_INTERPRET=1 python nvfp4_triton_cases.py CASE...`; exits non-zero on mismatch."""

import sys

import torch

from pdlab.kernels import nvfp4


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare(x, gs, masked_m=None, swizzle=False, config=None, what=""):
    p_ref, s_ref = nvfp4.quantize(x, gs, masked_m, swizzle=swizzle, backend="torch")
    p, s = nvfp4.quantize(x, gs, masked_m, swizzle=swizzle, backend="triton", config=config)
    bad_p = (p != p_ref).sum().item() if p.shape == p_ref.shape else -1
    bad_s = (s.view(torch.uint8) != s_ref.view(torch.uint8)).sum().item() if s.shape == s_ref.shape else -1
    assert _same(p, p_ref) and _same(s, s_ref), (
        f"{what} {list(x.shape)} {x.dtype} masked={masked_m is not None} swizzle={swizzle} config={config}: "
        f"{bad_p} packed bytes and {bad_s} scales differ")
    assert p.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn


def rounding_values(device) -> torch.Tensor:
    """fp32 values at and next to every e4m3 value and midpoint in [0, 448], every e2m1 threshold,
    and log-uniform random values over the whole e4m3 range (both signs)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    e2m1 = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e9])
    base = torch.cat([e4m3, mids, e2m1, torch.tensor([2.0**-10, 2.0**-9 * 0.5, 2.0**-9 * 1.5, 2.0**-7 * 1.0625])])
    up = torch.nextafter(base, torch.full_like(base, float("inf")))
    down = torch.nextafter(base, torch.zeros_like(base))
    g = torch.Generator().manual_seed(1)
    rand = torch.exp(torch.empty(4096).uniform_(-12, 6.2, generator=g))
    v = torch.cat([base, up, down, rand])
    return torch.cat([v, -v]).to(device)


def check_roundings(device) -> None:
    """The kernel's own e4m3 and e2m1 roundings and its pair packing equal torch's fp8 cast and the
    reference encoder."""
    import triton

    from pdlab.kernels.triton._nvfp4_quant_kernel import e4m3_e2m1_probe_kernel

    v = rounding_values(device)
    g = torch.Generator().manual_seed(2)
    v = torch.cat([v, v[torch.randperm(v.numel(), generator=g).to(device)]])  # every value next to others
    n = v.numel()
    val = torch.empty(n, dtype=torch.float32, device=device)
    byte = torch.empty(n, dtype=torch.uint8, device=device)
    code = torch.empty(n, dtype=torch.uint8, device=device)
    pairs = torch.empty(n, dtype=torch.uint8, device=device)
    e4m3_e2m1_probe_kernel[(triton.cdiv(n, 1024),)](v, val, byte, code, pairs, n, BLOCK=1024)
    want_pairs = nvfp4.pack_e2m1(nvfp4.e2m1_encode(v))
    for path, got in (("16-bit words", pairs[: n // 2]), ("fp32 words", pairs[n // 2:])):
        bad = (got != want_pairs).nonzero().flatten()
        assert bad.numel() == 0, f"packed pair ({path}) differs at {v.view(-1, 2)[bad[:4]].tolist()}"
    ref = torch.clamp(v.abs(), max=448.0).to(torch.float8_e4m3fn)
    bad = (byte != ref.view(torch.uint8)).nonzero().flatten()
    assert bad.numel() == 0, f"e4m3 differs at {v[bad[:8]].tolist()}: {byte[bad[:8]].tolist()} vs {ref.view(torch.uint8)[bad[:8]].tolist()}"
    assert torch.equal(val, ref.float())
    ref_code = nvfp4.e2m1_encode(v)
    bad = (code != ref_code).nonzero().flatten()
    assert bad.numel() == 0, f"e2m1 differs at {v[bad[:8]].tolist()}: {code[bad[:8]].tolist()} vs {ref_code[bad[:8]].tolist()}"


def check_small(device) -> None:
    """Tiny shapes: every input dtype, ragged tiles, 1-D, strided rows, scales far from 1."""
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(5, 96, generator=g, device=device) * torch.logspace(-6, 3, 96, device=device)).to(dtype)
        amax = x.float().abs().amax().reshape(1)
        gs = nvfp4.global_scale_from_amax(amax).to(device)
        for cfg in (None, {"BLOCK_M": 2, "BLOCK_K": 64}, {"BLOCK_M": 4, "BLOCK_K": 16, "num_warps": 1},
                    {"BLOCK_M": 2, "BLOCK_K": 32, "TILES_K": 2}, {"BLOCK_M": 8, "BLOCK_K": 16, "TILES_K": 4}):
            compare(x, gs, config=cfg, what="row-wise")
        compare(x, gs * 1000, what="saturating")
        compare(x, gs / 1e6, what="underflowing scales")
        compare(x, gs, swizzle=True, what="swizzled")
    wide = torch.randn(6, 80, generator=g, device=device)
    compare(wide[:, 16:64], torch.tensor([3.0], device=device), what="strided rows")
    compare(wide[0, :48], torch.tensor([0.7], device=device), what="1-D")
    compare(wide[:, :48], torch.arange(1, 7, dtype=torch.float32, device=device), what="per-row global scale")
    special = torch.zeros(2, 64, device=device)
    special[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    special[0, 16:32] = -0.0
    special[1, :16] = -torch.arange(16, device=device).float()
    special[1, 32] = 1e30
    special[1, 48] = torch.nextafter(torch.tensor(1.78125), torch.tensor(0.0))  # IEEE division decides
    compare(special, torch.tensor([1.0], device=device), what="ties, -0, all-negative, huge")


def check_masked(device) -> None:
    """Grouped [E, M, K] with masked_m and per-expert global scales, row-major and swizzled."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 7, 64, generator=g, device=device).to(torch.bfloat16)
    masked_m = torch.tensor([0, 3, 9], dtype=torch.int32, device=device)
    gs = torch.tensor([1.0, 100.0, 0.01], device=device)
    compare(x, gs, masked_m, what="masked")
    compare(x, gs, masked_m, swizzle=True, what="masked swizzled")
    compare(x, gs[1:2], None, swizzle=True, what="grouped, one global scale")
    compare(x, gs, masked_m, config={"BLOCK_M": 4, "BLOCK_K": 32}, what="masked, tiles across experts")
    compare(x, gs, masked_m, swizzle=True, config={"BLOCK_M": 4, "BLOCK_K": 16, "TILES_K": 3},
            what="masked swizzled, looped K-tiles")
    x = x.clone()
    x[1, 3:] = float("nan")  # rows past masked_m must not be read
    compare(x, gs, masked_m, what="masked rows never read")


def check_nonfinite(device) -> None:
    """NaN and ±Inf inputs: a block holding a NaN gets the NaN scale byte (it dequantises to NaN, as the reference
    does: the NaN is not hidden as a finite value); an infinite element saturates its block's scale to 448."""
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(5, 64, generator=g, device=device)
        x[0, 3] = float("nan")  # one NaN in block 0 of row 0
        x[1, 16:32] = float("nan")  # a whole block of NaN
        x[2, 17] = float("inf")
        x[3, 40] = float("-inf")
        x[4, 60], x[4, 5] = float("nan"), float("inf")
        x = x.to(dtype)
        gs = torch.tensor([10.0], device=device)
        compare(x, gs, what=f"non-finite {dtype}")
        compare(x, gs, swizzle=True, what=f"non-finite swizzled {dtype}")
        p, s = nvfp4.quantize(x, gs, backend="triton")
        deq = nvfp4.dequantize_nvfp4(p, s, gs)
        for r, b in ((0, 0), (1, 1), (4, 3)):
            assert deq[r, 16 * b:16 * b + 16].isnan().all(), f"{dtype} row {r} block {b}: the NaN was hidden"
        assert deq[2].isfinite().all() and deq[3].isfinite().all() and deq[0, 16:].isfinite().all()
    x = torch.randn(2, 3, 32, generator=g, device=device).to(torch.bfloat16)
    x[1, 0, 1] = float("nan")
    compare(x, torch.tensor([1.0, 2.0], device=device), torch.tensor([1, 2], dtype=torch.int32, device=device),
            what="non-finite masked")


def check_empty(device) -> None:
    """No rows or no columns (K = 0 is a multiple of 16): empty outputs of the reference's shapes, as the torch
    backend gives (K = 0 raised a bare view error before any check)."""
    for shape in ((0, 32), (3, 0), (2, 0, 32), (2, 3, 0)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.zeros(shape, dtype=dtype, device=device)
            compare(x, torch.tensor([1.0], device=device), what="empty")
            if x.dim() == 3:
                compare(x, torch.tensor([1.0, 2.0], device=device), torch.zeros(2, dtype=torch.int32, device=device),
                        what="empty masked")


CASES = {"roundings": check_roundings, "small": check_small, "masked": check_masked, "nonfinite": check_nonfinite,
         "empty": check_empty}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        CASES[name]("cpu")
        print(f"{name}: ok")
