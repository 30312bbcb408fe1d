"""NVFP4 reference: known answers computed by hand, round-trip bounds, the 128x4 swizzle, masked
rows, bad input, and interop with torch's own fp4/fp8 dtypes. Also the public `quantize` entry."""

import pytest
import torch

from pdlab.kernels import nvfp4
from pdlab.kernels.contracts import ShapeError

ALL_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _q(x, gs=1.0, masked_m=None):
    packed, scales = nvfp4.quantize_nvfp4(x, torch.tensor(gs), masked_m)
    return packed, scales.float(), nvfp4.unpack_e2m1(packed)


def test_every_code_both_signs():
    # amax 6 and global scale 1 give block scale e4m3(6/6*1) = 1, so values map to codes directly
    x = torch.tensor([v for v in ALL_VALUES] + [-v for v in ALL_VALUES])
    x[8] = -0.0
    packed, scales, codes = _q(x)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == list(range(16))
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # low nibble = even element
    assert nvfp4.dequantize_nvfp4(packed, scales, 1.0).tolist() == x.tolist()


def test_ties_round_to_even_and_neighbours_round_away():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # to the even code: 0, 2, 2, 4, 4, 6, 6
    x = torch.tensor(ties + [6.0] + [-t for t in ties] + [-6.0])
    got = nvfp4.dequantize_nvfp4(*_q(x)[:2], 1.0)
    assert got.tolist() == want + [6.0] + [-w for w in want] + [-6.0]
    up = torch.tensor([torch.nextafter(torch.tensor(t), torch.tensor(9.0)).item() for t in ties] + [6.0] * 9)
    down = torch.tensor([torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item() for t in ties] + [6.0] * 9)
    assert nvfp4.dequantize_nvfp4(*_q(up)[:2], 1.0)[:7].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert nvfp4.dequantize_nvfp4(*_q(down)[:2], 1.0)[:7].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_block_scale_is_e4m3_rounded_and_blocks_are_independent():
    # block 0: amax 1.8 -> 1.8/6 = 0.3 -> e4m3 0.3125 (1.25 * 2^-2); block 1: amax 3 -> 0.5 exactly
    x = torch.zeros(32)
    x[0], x[16] = 1.8, -3.0
    packed, scales, codes = _q(x)
    assert scales.tolist() == [0.3125, 0.5]
    # 1.8 / 0.3125 = 5.76 -> 6 (code 7); -3 / 0.5 = -6 -> code 15
    assert codes[0].item() == 7 and codes[16].item() == 15
    assert codes[1:16].eq(0).all() and codes[17:].eq(0).all()


def test_block_scale_uses_ieee_division():
    # 1.78125 / 6 = 0.296875 is the midpoint of e4m3 0.28125 and 0.3125; one ulp below 1.78125 the
    # exact quotient is below it (-> 0.28125), while amax * fp32(1/6) lands above it (-> 0.3125)
    amax = torch.nextafter(torch.tensor(1.78125), torch.tensor(0.0))
    assert (amax * torch.tensor(1 / 6)).to(torch.float8_e4m3fn).float().item() == 0.3125
    x = torch.zeros(16)
    x[3] = amax
    assert _q(x)[1].tolist() == [0.28125]


@pytest.mark.gpu
def test_reference_is_the_same_on_gpu_and_cpu():
    x = torch.randn(512, 1024) * torch.exp(2 * torch.randn(1024))
    x[0, :16] = torch.nextafter(torch.tensor(1.78125), torch.tensor(0.0))
    for gs in (torch.tensor(1.0), nvfp4.global_scale_from_amax(x.abs().amax())):
        p_cpu, s_cpu = nvfp4.quantize_nvfp4(x, gs)
        p_gpu, s_gpu = nvfp4.quantize_nvfp4(x.cuda(), gs.cuda())
        assert torch.equal(p_gpu.cpu(), p_cpu)
        assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8))


def test_zero_and_negative_zero_blocks():
    packed, scales, codes = _q(torch.zeros(2, 32))
    assert packed.eq(0).all() and scales.eq(0).all()
    packed, scales, codes = _q(torch.full((16,), -0.0))
    assert scales.eq(0).all() and codes.eq(8).all()  # sign kept, value zero
    assert nvfp4.dequantize_nvfp4(packed, scales, 1.0).eq(0).all()


def test_all_negative_block():
    x = -torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.25] * 2)
    packed, scales, codes = _q(x)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [15, 14, 13, 12, 11, 10, 9, 8] * 2  # -0.25 ties to -0 (code 8)


def test_values_beyond_range_saturate():
    gs = 2.0
    limit = 6 * 448 / gs  # the largest magnitude representable: 6 * 448 / global_scale
    x = torch.tensor([1e9, -3 * limit, limit, 1.0] + [0.0] * 12)
    packed, scales, codes = _q(x, gs)
    assert scales.tolist() == [448.0]
    deq = nvfp4.dequantize_nvfp4(packed, scales, gs)
    assert deq[:3].tolist() == [limit, -limit, limit]
    assert x.new_tensor(float("inf")).isinf()
    packed, scales, codes = _q(torch.tensor([float("inf")] + [1.0] * 15), gs)
    assert scales.tolist() == [448.0] and codes[0].item() == 7


def test_tiny_block_scale_underflows_to_zero():
    x = torch.full((16,), 1e-12)
    packed, scales, codes = _q(x, 1.0)  # 1e-12/6 is far below e4m3's smallest subnormal 2^-9
    assert scales.eq(0).all() and codes.eq(0).all()


def test_round_trip_error_bound(seed):
    x = torch.randn(64, 256) * torch.exp(torch.randn(256))
    gs = nvfp4.global_scale_from_amax(x.abs().amax())
    packed, scales = nvfp4.quantize_nvfp4(x, gs)
    deq = nvfp4.dequantize_nvfp4(packed, scales, gs)
    err = (deq - x).abs().unflatten(-1, (-1, 16))
    amax = x.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
    # the largest E2M1 step is 2 (4 -> 6): error <= 1 step-half in scaled units, scale rounding <= 2^-4
    assert (err <= amax / 6 * (1 + 2**-4) + 1e-30).all()
    rel = (deq - x).norm() / x.norm()
    assert 0.01 < rel < 0.15


def test_grouped_global_scale_per_expert_and_masked_rows():
    x = torch.randn(3, 5, 32)
    gs = torch.tensor([1.0, 100.0, 0.01])
    packed, scales = nvfp4.quantize_nvfp4(x, gs)
    for e in range(3):
        p_e, s_e = nvfp4.quantize_nvfp4(x[e], gs[e])
        assert torch.equal(packed[e], p_e) and torch.equal(scales[e].float(), s_e.float())
    masked_m = torch.tensor([0, 2, 7], dtype=torch.int32)
    pm, sm = nvfp4.quantize_nvfp4(x, gs, masked_m)
    assert pm[0].eq(0).all() and sm[0].float().eq(0).all()
    assert pm[1, 2:].eq(0).all() and sm[1, 2:].float().eq(0).all()
    assert torch.equal(pm[1, :2], packed[1, :2]) and torch.equal(pm[2], packed[2])
    x_nan = x.clone()
    x_nan[1, 2:] = float("nan")  # rows past masked_m are never read
    assert torch.equal(nvfp4.quantize_nvfp4(x_nan, gs, masked_m)[0], pm)


def test_modelopt_weight_scales():
    w = torch.randn(2, 8, 64)
    out = nvfp4.quantize_weight_modelopt(w)
    amax = w.abs().amax(dim=(1, 2))
    assert torch.allclose(out["weight_scale_2"], amax / (6 * 448))
    assert out["weight"].shape == (2, 8, 32) and out["weight_scale"].shape == (2, 8, 4)
    assert out["weight_scale"].float().max() <= 448


def test_swizzle_offsets_match_formula_and_invert():
    L, M, K16 = 2, 130, 6  # both M and K16 need padding
    s = torch.arange(1, L * M * K16 + 1, dtype=torch.float32).reshape(L, M, K16)
    sw = nvfp4.swizzle_scales_128x4(s)
    assert sw.shape == (L, 2, 2, 32, 4, 4)
    flat = sw.reshape(L, -1)
    for m in list(range(0, M, 7)) + [31, 32, 127, 128, 129]:
        for k in range(K16):
            assert flat[1, nvfp4.swizzled_offset(m, k, K16)].item() == s[1, m, k].item()
    assert nvfp4.swizzled_offset(0, 0, 8) == 0
    assert nvfp4.swizzled_offset(33, 5, 8) == 512 + 1 * 16 + 1 * 4 + 1
    assert nvfp4.swizzled_offset(128, 0, 8) == 2 * 512
    assert (flat != 0).sum().item() == L * M * K16  # padding is zero
    assert torch.equal(nvfp4.unswizzle_scales_128x4(sw, M, K16), s)
    assert torch.equal(nvfp4.unswizzle_scales_128x4(sw[0], M, K16), s[0])
    e4 = s[0].to(torch.float8_e4m3fn)
    assert torch.equal(nvfp4.swizzle_scales_128x4(e4).view(torch.uint8).reshape(-1)[
        nvfp4.swizzled_offset(5, 3, K16)], e4.view(torch.uint8)[5, 3])


def test_bad_inputs_raise_shape_errors():
    with pytest.raises(ShapeError, match="K=40, not a multiple of 16"):
        nvfp4.quantize_nvfp4(torch.zeros(4, 40), 1.0)
    with pytest.raises(ShapeError, match="wrong dtype"):
        nvfp4.quantize_nvfp4(torch.zeros(4, 32, dtype=torch.int32), 1.0)
    with pytest.raises(ShapeError, match=r"has 2 dims instead of 3.*\[E=2, M, K\].*quantize it without masked_m"):
        nvfp4.quantize_nvfp4(torch.zeros(4, 32), 1.0, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ShapeError, match="'masked_m' has the wrong dtype"):
        nvfp4.quantize_nvfp4(torch.zeros(2, 4, 32), 1.0, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ShapeError, match="K=40"):
        nvfp4.quantize(torch.zeros(4, 40), 1.0, backend="torch")
    with pytest.raises(ShapeError, match="'global_scale' does not fit.*1 or 4 elements"):
        nvfp4.quantize(torch.zeros(4, 32), torch.ones(3), backend="torch")
    with pytest.raises(ShapeError, match="'global_scale' does not fit"):
        nvfp4.quantize(torch.zeros(4, 32), torch.ones(1, dtype=torch.float64), backend="torch")
    with pytest.raises(ShapeError, match="2-D or 3-D for swizzled"):
        nvfp4.quantize(torch.zeros(32), 1.0, swizzle=True, backend="torch")
    with pytest.raises(ShapeError, match=r"stride\(-1\) == 1"):
        nvfp4.quantize(torch.zeros(32, 4).t(), 1.0, backend="torch")


def test_public_quantize_matches_reference_and_swizzles(seed):
    x = torch.randn(2, 130, 64, dtype=torch.bfloat16)
    gs = torch.tensor([3.0, 0.5])
    masked_m = torch.tensor([100, 130], dtype=torch.int32)
    p, s = nvfp4.quantize(x, gs, masked_m)  # default backend on CPU: torch
    rp, rs = nvfp4.quantize_nvfp4(x, gs, masked_m)
    assert torch.equal(p, rp) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    _, sw = nvfp4.quantize(x, gs, masked_m, swizzle=True, backend="torch")
    assert sw.shape == (2, 2, 1, 32, 4, 4) and sw.dtype == torch.float8_e4m3fn
    assert torch.equal(nvfp4.unswizzle_scales_128x4(sw.view(torch.uint8), 130, 4), rs.view(torch.uint8))
    p1, s1 = nvfp4.quantize(x[0, 0], 2.5, backend="torch")  # 1-D, Python float scale
    assert torch.equal(p1, nvfp4.quantize_nvfp4(x[0, 0], 2.5)[0])


def test_torch_fp4_dtype_interop():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        with pytest.raises(RuntimeError, match="no float4_e2m1fn_x2"):
            nvfp4.as_torch_fp4(torch.zeros(2, dtype=torch.uint8))
        return
    packed, scales = nvfp4.quantize_nvfp4(torch.randn(4, 32), 1.0)
    t = nvfp4.as_torch_fp4(packed)
    assert t.dtype == torch.float4_e2m1fn_x2 and t.shape == packed.shape
    assert t.data_ptr() == packed.data_ptr()
    assert torch.equal(nvfp4.from_torch_fp4(t), packed)
    assert scales.dtype == torch.float8_e4m3fn
    # e4m3 scales agree with torch's own fp8 cast of the fp32 values
    assert torch.equal(scales.float().to(torch.float8_e4m3fn).view(torch.uint8), scales.view(torch.uint8))


def test_one_element_global_scale_is_a_scalar():
    x = torch.randn(4, 32)
    want = nvfp4.quantize_nvfp4(x, torch.tensor(7.0))
    for gs in (7.0, torch.tensor([7.0]), torch.tensor([[7.0]])):
        got = nvfp4.quantize_nvfp4(x, gs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    with pytest.raises(ValueError, match=r"one value per leading index \(\[4\]\), got shape \[2\]"):
        nvfp4.quantize_nvfp4(x, torch.ones(2))


def test_global_scale_from_amax():
    assert nvfp4.global_scale_from_amax(torch.tensor([2688.0, 0.0])).tolist() == [1.0, 1.0]
    assert nvfp4.global_scale_from_amax(1.0).item() == 2688.0
