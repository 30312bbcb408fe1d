"""Op contracts: dims bind across arguments, scaled dims, ellipsis, dtype/device/contiguity errors,
and the readable error for a 2-D tensor handed to a masked-layout runner."""

import pytest
import torch

from pdlab.kernels.contracts import Dim, Op, ShapeError, Spec, describe_tensor, parse_dtypes

MASKED_HINT = ("A 2-D input comes from normal-mode dispatch: use low-latency dispatch with this runner, "
               "or a runner that accepts the contiguous layout (triton, torch).")

EXPERTS = Op(
    "moe.experts",
    inputs={
        "masked_m": Spec("E", "int32"),
        "hidden": Spec("E M K", "bf16|uint8", layout="masked", last_dim_contiguous=True),
        "w13": Spec("E 2*I K/2", "uint8", contiguous=True),
        "w13_scale": Spec("E 2*I K/16", "fp8_e4m3"),
        "w2": Spec("E K I/2", "uint8"),
    },
    outputs={"out": Spec("E M K", "bf16")},
    hints={"hidden": lambda problem, value, dims: MASKED_HINT if "dims" in problem else None},
)


def _experts(e=4, m=8, k=64, i=32, device="cpu"):
    return {"masked_m": torch.zeros(e, dtype=torch.int32, device=device),
            "hidden": torch.zeros(e, m, k, dtype=torch.bfloat16, device=device),
            "w13": torch.zeros(e, 2 * i, k // 2, dtype=torch.uint8, device=device),
            "w13_scale": torch.zeros(e, 2 * i, k // 16, dtype=torch.float8_e4m3fn, device=device),
            "w2": torch.zeros(e, k, i // 2, dtype=torch.uint8, device=device)}


def test_dims_bind_across_arguments_with_scaled_tokens():
    dims = EXPERTS.check("cutedsl", **_experts(e=4, m=8, k=64, i=32))
    assert dims == {"E": 4, "M": 8, "K": 64, "I": 32}


def test_masked_runner_given_2d_tensor_reads_clearly():
    t = _experts(e=64, k=7168, i=16)
    t["hidden"] = torch.empty(4096, 7168, dtype=torch.bfloat16, device="meta")
    t = {k: (v if k == "hidden" else v.to("meta")) for k, v in t.items()}
    with pytest.raises(ShapeError) as info:
        EXPERTS.check("cutedsl", **t)
    msg = str(info.value)
    assert msg.startswith("moe.experts[cutedsl] argument 'hidden' has 2 dims instead of 3")
    assert "expects [E=64, M, K] bf16|uint8 (masked layout)" in msg
    assert "got [4096, 7168] bf16 meta" in msg
    assert MASKED_HINT in msg
    err = info.value
    assert (err.op, err.backend, err.argument, err.hint) == ("moe.experts", "cutedsl", "hidden", MASKED_HINT)
    assert isinstance(err, ValueError)


def test_scaled_dim_mismatch_names_bound_values():
    t = _experts(e=4, k=64, i=32)
    t["w13"] = torch.zeros(4, 64, 33, dtype=torch.uint8)  # K/2 should be 32
    with pytest.raises(ShapeError, match=r"'w13' has size 33 at dim 2 where K/2=32 \(bound K=64\)"):
        EXPERTS.check("x", **t)
    t = _experts(e=4, k=64, i=32)
    t["w2"] = torch.zeros(4, 64, 15, dtype=torch.uint8)  # I/2 = 16 (I bound by 2*I = 64)
    with pytest.raises(ShapeError, match=r"I/2=16"):
        EXPERTS.check("x", **t)


def test_first_binding_must_be_whole():
    op = Op("t", inputs={"a": Spec("2*N")})
    with pytest.raises(ShapeError, match="not 2\\*N for any whole N"):
        op.check(a=torch.zeros(5))
    assert op.check(a=torch.zeros(6)) == {"N": 3}


def test_binding_divided_dim_first():
    op = Op("t", inputs={"s": Spec("M K/16"), "x": Spec("M K")})
    assert op.check(s=torch.zeros(2, 3), x=torch.zeros(2, 48)) == {"M": 2, "K": 48}
    with pytest.raises(ShapeError, match="K=48"):
        op.check(s=torch.zeros(2, 3), x=torch.zeros(2, 40))


def test_ellipsis_and_literals():
    op = Op("t", inputs={"x": Spec("... 576", "fp32"), "y": Spec("... K")})
    assert op.check(x=torch.zeros(2, 3, 576), y=torch.zeros(7)) == {"K": 7}
    assert op.check(x=torch.zeros(576)) == {}
    with pytest.raises(ShapeError, match="576 is required"):
        op.check(x=torch.zeros(2, 512))
    with pytest.raises(ShapeError, match="at least 1"):
        op.check(y=torch.zeros(()))


def test_dtype_device_contiguity_and_type_errors():
    t = _experts()
    t["hidden"] = t["hidden"].float()
    with pytest.raises(ShapeError, match="wrong dtype.*bf16\\|uint8.*got \\[4, 8, 64\\] fp32"):
        EXPERTS.check("x", **t)
    t = _experts()
    t["w2"] = t["w2"].to("meta")
    with pytest.raises(ShapeError, match="'w2' is on meta while the other tensors are on cpu"):
        EXPERTS.check("x", **t)
    t = _experts()
    t["w13"] = torch.zeros(4, 32, 64, dtype=torch.uint8).transpose(1, 2)
    with pytest.raises(ShapeError, match="must be contiguous"):
        EXPERTS.check("x", **t)
    t = _experts()
    t["hidden"] = torch.zeros(4, 64, 8, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ShapeError, match=r"stride\(-1\) == 1"):
        EXPERTS.check("x", **t)
    t = _experts()
    t["masked_m"] = [1, 2, 3, 4]
    with pytest.raises(ShapeError, match="must be a torch.Tensor"):
        EXPERTS.check("x", **t)
    t = _experts()
    t["hidden"] = None
    with pytest.raises(ShapeError, match="is required"):
        EXPERTS.check("x", **t)


def test_optional_outputs_and_unknown_names():
    op = Op("t", inputs={"x": Spec("N"), "bias": Spec("N", optional=True)}, outputs={"y": Spec("N", "fp32")})
    assert op.check(x=torch.zeros(3), bias=None) == {"N": 3}
    with pytest.raises(ShapeError, match="'y' has size 4"):
        op.check(x=torch.zeros(3), y=torch.zeros(4))
    with pytest.raises(TypeError, match="no argument named 'z'"):
        op.check(z=torch.zeros(1))
    with pytest.raises(ValueError, match="both inputs and outputs"):
        Op("bad", inputs={"a": Spec("N")}, outputs={"a": Spec("N")})


def test_prebound_dims_and_require():
    op = Op("t", inputs={"kv": Spec("P page 576")}, hints={"kv": "use page size 64"})
    with pytest.raises(ShapeError, match="use page size 64"):
        op.check("flashmla", bound={"page": 64}, kv=torch.zeros(2, 32, 576))
    with pytest.raises(ShapeError, match="t\\[b\\] argument 'kv' too long: expects <= 4 but got"):
        op.require("b", False, "kv", "too long", torch.zeros(1), "<= 4")
    op.require("b", True, "kv", "never", None, "")


def test_dim_tokens_and_dtypes():
    assert Dim.parse("2*I/16") == Dim("2*I/16", name="I", mul=2, div=16)
    assert Dim.parse("K*2").mul == 2
    with pytest.raises(ValueError, match="bad dimension token"):
        Dim.parse("K+1")
    assert parse_dtypes("bf16|fp16") == {torch.bfloat16, torch.float16}
    assert parse_dtypes(None) is None
    with pytest.raises(ValueError, match="unknown dtype 'bf17'"):
        parse_dtypes("bf17")
    assert describe_tensor(torch.zeros(2, 3, dtype=torch.int32)) == "[2, 3] int32 cpu"
    rendered = Spec("E M K/2", "uint8", layout="masked").render({"E": 3, "K": 64})
    assert rendered == "[E=3, M, K/2=32] uint8 (masked layout)"
