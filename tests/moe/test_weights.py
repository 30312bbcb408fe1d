"""ExpertWeights: bf16 → NVFP4 (modelopt recipe), modelopt loading with named shape errors, repack cache."""

import pytest
import torch

from pdlab.kernels.contracts import ShapeError
from pdlab.kernels.nvfp4 import dequantize_nvfp4
from pdlab.moe.weights import ExpertWeights

E, H, I = 3, 64, 32


def _bf16():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16()


def test_from_bf16_quantizes_per_expert():
    w13, w2 = _bf16()
    w13[1] *= 10  # a per-expert weight_scale_2 must follow each expert's own amax
    w = ExpertWeights.from_bf16(w13, w2)
    assert w.w13_weight.shape == (E, 2 * I, H // 2) and w.w13_weight.dtype == torch.uint8
    assert w.w13_weight_scale.shape == (E, 2 * I, H // 16) and w.w13_weight_scale.dtype == torch.float8_e4m3fn
    assert w.w2_weight.shape == (E, H, I // 2) and w.w2_weight_scale_2.shape == (E,)
    torch.testing.assert_close(w.w13_weight_scale_2, w13.float().abs().amax((1, 2)) / (6 * 448))
    d13, d2 = w.dequantized()
    for e in range(E):
        rel = (d13[e] - w13[e].float()).norm() / w13[e].float().norm()
        assert rel < 0.15
    assert w.has_bf16 and w.has_nvfp4
    assert ExpertWeights.from_bf16(w13, w2, quantize=False).has_nvfp4 is False


def _modelopt():
    w13, w2 = _bf16()
    w = ExpertWeights.from_bf16(w13, w2)
    return {"w13_weight": w.w13_weight, "w13_weight_scale": w.w13_weight_scale,
            "w13_weight_scale_2": w.w13_weight_scale_2, "w13_input_scale": w.w13_input_scale,
            "w2_weight": w.w2_weight, "w2_weight_scale": w.w2_weight_scale.view(torch.uint8),
            "w2_weight_scale_2": w.w2_weight_scale_2, "w2_input_scale": torch.tensor(0.01)}, w


def test_from_modelopt_roundtrip_and_scalars():
    t, w = _modelopt()
    loaded = ExpertWeights.from_modelopt({"model.layers.3.mlp.experts." + k: v for k, v in t.items()},
                                         prefix="model.layers.3.mlp.experts.")
    assert (loaded.num_experts, loaded.hidden_size, loaded.intermediate_size) == (E, H, I)
    assert loaded.w2_weight_scale.dtype == torch.float8_e4m3fn
    assert loaded.w2_input_scale.tolist() == pytest.approx([0.01] * E)
    a, b = loaded.dequantized(), w.dequantized()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(loaded.activation_global_scale, 1 / w.w13_input_scale.max())


def test_from_modelopt_folds_separate_gate_up_scale_2():
    t, w = _modelopt()
    s = t["w13_weight_scale_2"]
    t["w13_weight_scale_2"] = torch.stack([s, s / 2], dim=1)  # up half declared with half the scale
    loaded = ExpertWeights.from_modelopt(t)
    torch.testing.assert_close(loaded.w13_weight_scale_2, s)
    d = loaded.dequantized()[0]
    ref = w.dequantized()[0]
    torch.testing.assert_close(d[:, :I], ref[:, :I])
    rel = (d[:, I:] - ref[:, I:] / 2).norm() / (ref[:, I:] / 2).norm()
    assert rel < 0.05  # rescaled e4m3 block scales round


@pytest.mark.parametrize("name,bad,match", [
    ("w13_weight", torch.zeros(2 * I, H // 2, dtype=torch.uint8), "w13_weight"),
    ("w2_weight", torch.zeros(E, H, I, dtype=torch.uint8), "w2_weight"),
    ("w13_weight_scale", torch.zeros(E, 2 * I, H // 8, dtype=torch.uint8), "w13_weight_scale"),
    ("w2_weight", torch.zeros(E + 1, H, I // 2, dtype=torch.uint8), "w2_weight"),
])
def test_from_modelopt_shape_errors_name_the_tensor(name, bad, match):
    t, _ = _modelopt()
    t[name] = bad
    with pytest.raises(ShapeError, match=f"'{match}'"):
        ExpertWeights.from_modelopt(t)


def test_from_modelopt_missing_and_bad_scale_2():
    t, _ = _modelopt()
    with pytest.raises(KeyError, match="w2_weight_scale_2"):
        ExpertWeights.from_modelopt({k: v for k, v in t.items() if k != "w2_weight_scale_2"})
    t["w2_weight_scale_2"] = torch.ones(E + 2)
    with pytest.raises(ValueError, match="w2_weight_scale_2"):
        ExpertWeights.from_modelopt(t)


def test_prepare_caches_once_and_to_drops():
    t, _ = _modelopt()
    w = ExpertWeights.from_modelopt(t)
    calls = []
    build = lambda ww: calls.append(1) or {"x": 1}  # noqa: E731
    assert w.prepare("r", build) is w.prepare("r", build)
    assert len(calls) == 1
    moved = w.to("cpu")
    assert moved.prepared == {} and torch.equal(moved.w13_weight, w.w13_weight)
    # bf16 view of NVFP4-only weights is dequantised once and cached
    b1 = w.bf16()
    assert b1[0].dtype == torch.bfloat16 and w.bf16()[0] is b1[0]
    torch.testing.assert_close(b1[0].float(), dequantize_nvfp4(w.w13_weight, w.w13_weight_scale,
                                                                1 / w.w13_weight_scale_2), rtol=1e-2, atol=1e-3)
