"""NVFP4 quantize / dequantize on bad input: host global scales that cannot scale, K = 0, scales that do not fit
the packed bytes."""

import pytest
import torch

from pdlab.kernels import nvfp4
from pdlab.kernels.contracts import ShapeError

BAD_SCALES = [0.0, -2.0, float("nan"), float("inf"), True]


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_quantize_names_a_host_global_scale_that_cannot_scale(bad):
    """0 gave NaN on dequantization, a negative scale zeros, NaN NaN blocks (torch) or ±6·448 (triton, under the
    interpreter): silently. The op checks the host number before any backend runs."""
    with pytest.raises(ValueError, match=r"global_scale.*finite number > 0"):
        nvfp4.quantize(torch.randn(3, 32), bad, backend="torch")


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_reference_quantize_and_dequantize_name_a_host_global_scale_that_cannot_scale(bad):
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match=r"global_scale.*finite number > 0"):
        nvfp4.quantize_nvfp4(x, bad)
    packed, scales = nvfp4.quantize_nvfp4(x, 1.0)
    with pytest.raises(ValueError, match=r"global_scale.*finite number > 0"):
        nvfp4.dequantize_nvfp4(packed, scales, bad)


def test_dequantize_names_scales_that_do_not_fit_the_bytes():
    """A bare broadcast error from inside torch ('size of tensor a (2) must match ...') became a ShapeError naming
    scales, the shape expected and the fix."""
    packed, scales = nvfp4.quantize_nvfp4(torch.randn(3, 32), 1.0)
    with pytest.raises(ShapeError, match=r"nvfp4_dequantize argument 'scales'.*K/16=2"):
        nvfp4.dequantize_nvfp4(packed, scales[:, :1], 1.0)
    with pytest.raises(ShapeError, match=r"'scales'.*row-major.*unswizzle_scales_128x4"):
        nvfp4.dequantize_nvfp4(packed, nvfp4.swizzle_scales_128x4(scales), 1.0)
    with pytest.raises(ShapeError, match=r"'scales'.*\[3, K/16=2\]"):
        nvfp4.dequantize_nvfp4(packed, scales[:2], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_dequantize_names_packed_bytes_of_another_dtype(dtype):
    """Float bytes raised NotImplementedError from a bitwise op; int32 'bytes' were read as nibbles silently."""
    _, scales = nvfp4.quantize_nvfp4(torch.randn(3, 32), 1.0)
    with pytest.raises(ShapeError, match=r"'packed' has the wrong dtype.*uint8"):
        nvfp4.dequantize_nvfp4(torch.zeros(3, 16, dtype=dtype), scales, 1.0)


def test_dequantize_round_trips_plain_and_grouped():
    x = torch.randn(2, 3, 32)
    gs = torch.tensor([1.0, 4.0])
    packed, scales = nvfp4.quantize_nvfp4(x, gs)
    for s in (scales, scales.view(torch.uint8)):
        y = nvfp4.dequantize_nvfp4(packed, s, gs)
        assert y.shape == x.shape and (y - x).abs().max() < 0.5 * x.abs().max()
    assert nvfp4.dequantize_nvfp4(packed[0, 0], scales[0, 0], 1.0).shape == (32,)


def test_swizzle_helpers_name_a_tensor_of_the_wrong_rank_or_size():
    # a 1-D tensor to swizzle and a wrong m to unswizzle ended in bare unpack / view errors
    from pdlab.kernels.nvfp4 import swizzle_scales_128x4, unswizzle_scales_128x4

    with pytest.raises(ValueError, match=r"swizzle_scales_128x4: scales must be \[M, K16\].*1-D \(8,\)"):
        swizzle_scales_128x4(torch.zeros(8, dtype=torch.uint8))
    scales = torch.arange(130 * 5, dtype=torch.float32).reshape(130, 5)
    sw = swizzle_scales_128x4(scales)
    assert torch.equal(unswizzle_scales_128x4(sw, 130, 5), scales)
    assert torch.equal(unswizzle_scales_128x4(sw.flatten(), 130, 5), scales)  # its flat view
    with pytest.raises(ValueError, match=r"m=300, k16=5 need 3072 scales.*holds 2048.*the m and k16 it was swizzled"):
        unswizzle_scales_128x4(sw, 300, 5)
    with pytest.raises(ValueError, match=r"got 3-D"):
        unswizzle_scales_128x4(sw.reshape(2, 4, 256), 130, 5)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_global_scale_from_amax_names_an_amax_that_is_no_absolute_maximum(bad):
    # a negative or NaN amax gave scale 1 without a word, inf gave 0 (every value then quantizes to 0)
    from pdlab.kernels.nvfp4 import global_scale_from_amax

    with pytest.raises(ValueError, match=r"amax=.* is no absolute maximum"):
        global_scale_from_amax(bad)
    assert float(global_scale_from_amax(6.0)) == pytest.approx(448.0) and float(global_scale_from_amax(0.0)) == 1.0
