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
