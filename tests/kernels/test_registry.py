"""Backend registry: probe reasons, preference order, explicit selection errors, config keys, matrix."""

import pytest
import torch

from pdlab.kernels import registry
from pdlab.kernels.arch import arch_family, detect_arch, device_facts, _peaks_for_name
from pdlab.kernels.registry import register_backend


@pytest.fixture
def op_name(request):
    name = f"test_op_{request.node.name}"
    yield name
    registry._REGISTRY.pop(name, None)
    registry._PROBE_CACHE.clear()


def _register(op, name, **kw):
    kw.setdefault("archs", ("cpu", "cuda"))
    register_backend(op, name, **kw)(lambda *a, **k: name)


def test_probe_reasons(op_name):
    _register(op_name, "needs_sm100", archs=("sm100",))
    _register(op_name, "needs_pkg", packages=("surely_not_installed_pkg_xyz",))
    _register(op_name, "probe_says_no", probe=lambda: "driver too old")

    def boom():
        raise OSError("cannot open device")

    _register(op_name, "probe_raises", probe=boom)
    _register(op_name, "fine")
    assert registry.unavailable_reason(op_name, "needs_sm100", "cpu") == "needs sm100, this machine is cpu"
    assert registry.unavailable_reason(op_name, "needs_sm100", "sm103") is None  # sm103 is in the sm100 family
    assert registry.unavailable_reason(op_name, "needs_sm100", "sm90") == "needs sm100, this machine is sm90"
    assert registry.unavailable_reason(op_name, "needs_pkg", "cpu") == "package surely_not_installed_pkg_xyz not installed"
    assert registry.unavailable_reason(op_name, "probe_says_no", "cpu") == "driver too old"
    assert registry.unavailable_reason(op_name, "probe_raises", "cpu") == "probe failed: OSError: cannot open device"
    assert [b.name for b in registry.available(op_name, "cpu")] == ["fine"]
    rows = {r["backend"]: r for r in registry.matrix("cpu") if r["op"] == op_name}
    assert rows["fine"]["available"] and not rows["needs_pkg"]["available"]
    assert rows["probe_says_no"]["reason"] == "driver too old"


def test_selection_order_and_accept(op_name):
    _register(op_name, "slow_ref", priority=0, reference=True)
    _register(op_name, "fast", priority=50, options={"page_sizes": (64,)})
    _register(op_name, "fastest_elsewhere", priority=100, archs=("sm90",))
    assert registry.select(op_name, device="cpu").name == "fast"
    picked = registry.select(op_name, device="cpu", accept=lambda b: 32 in b.options.get("page_sizes", (32,)))
    assert picked.name == "slow_ref"
    assert [b.name for b in registry.backends(op_name)] == ["fastest_elsewhere", "fast", "slow_ref"]
    assert registry.select(op_name, "slow_ref", device="cpu").impl() == "slow_ref"


def test_explicit_unusable_backend_and_unknown_names(op_name):
    _register(op_name, "hopper_only", archs=("sm90",))
    _register(op_name, "ref", reference=True)
    with pytest.raises(RuntimeError, match=r"backend 'hopper_only' is unavailable: needs sm90, this machine is "
                                           r"cpu\. Usable here: ref"):
        registry.select(op_name, "hopper_only", device="cpu")
    with pytest.raises(KeyError, match="has no backend named 'nope'; registered: hopper_only, ref"):
        registry.select(op_name, "nope", device="cpu")
    with pytest.raises(KeyError, match="no op named"):
        registry.backends(op_name + "_missing")
    with pytest.raises(RuntimeError, match="no usable backend.*hopper_only: needs sm90.*ref: rejected"):
        registry.select(op_name, device="cpu", accept=lambda b: False)


def test_config_defaults_and_unknown_keys(op_name):
    _register(op_name, "t", config_space={"BLOCK": [32, 64]}, default_config={"BLOCK": 64, "num_warps": 4})
    b = registry.get_backend(op_name, "t")
    assert b.config() == {"BLOCK": 64, "num_warps": 4}
    assert b.config({"BLOCK": 32}) == {"BLOCK": 32, "num_warps": 4}
    with pytest.raises(ValueError, match=r"unknown config keys \['BLOCK_N'\]; known: \['BLOCK', 'num_warps'\]"):
        b.config({"BLOCK_N": 16})


def test_reregistering_replaces_and_clears_probe_cache(op_name):
    _register(op_name, "x", probe=lambda: "old reason")
    assert registry.unavailable_reason(op_name, "x", "cpu") == "old reason"
    _register(op_name, "x", probe=lambda: None)
    assert registry.unavailable_reason(op_name, "x", "cpu") is None


def test_nvfp4_backends_registered():
    import pdlab.kernels.nvfp4  # noqa: F401  (registers torch and triton)

    names = {b.name: b for b in registry.backends("nvfp4_quantize")}
    assert names["torch"].reference and not names["triton"].reference
    assert names["triton"].priority > names["torch"].priority
    assert registry.unavailable_reason("nvfp4_quantize", "torch", "cpu") is None


def test_arch_facts():
    assert arch_family("sm90a") == "sm90" and arch_family("sm103") == "sm100"
    assert detect_arch("cpu") == "cpu"
    assert _peaks_for_name("NVIDIA H200").hbm_bytes_per_s == 4.8e12
    assert _peaks_for_name("NVIDIA H20").hbm_bytes_per_s == 4.0e12
    assert _peaks_for_name("NVIDIA GB200").fp4_flops == 10000e12
    assert _peaks_for_name("NVIDIA B200").fp4_flops == 9000e12
    assert _peaks_for_name("Some Other GPU") is None
    if not torch.cuda.is_available():
        facts = device_facts()
        assert (facts.arch, facts.peaks, facts.key) == ("cpu", None, "cpu")


def test_programs_per_sm_known_answers():
    # sm90: 65536 registers, 228 KB of shared memory (1 KB more per resident program), 64 warps, 32 programs
    from pdlab.kernels.arch import SM90

    # the Gluon fp8 decode kernel: 4 warps × 236 registers, 94 464 B → two (by both); 128 regs would allow four
    assert SM90.programs_per_sm(registers=236, shared=94464, warps=4) == \
        {"programs_per_sm": 2, "by_registers": 2, "by_shared": 2}
    assert SM90.programs_per_sm(registers=128, shared=40000, warps=4)["programs_per_sm"] == 4
    # one 8-warp program at 255 registers; 115 200 B still fits twice (2 × 116 224 ≤ 233 472), 116 000 does not
    assert SM90.programs_per_sm(registers=255, shared=1024, warps=8)["programs_per_sm"] == 1
    assert SM90.programs_per_sm(registers=None, shared=115200, warps=4)["programs_per_sm"] == 2
    assert SM90.programs_per_sm(registers=None, shared=116000, warps=4)["programs_per_sm"] == 1
    assert SM90.programs_per_sm(registers=None, shared=0, warps=1)["programs_per_sm"] == 32  # the program cap
