"""Timing harness on CPU, cosine_error, roofline arithmetic."""

import math
import time

import pytest
import torch

from pdlab.bench.harness import Timing, _quantiles, bench, cosine_error
from pdlab.bench.roofline import roofline
from pdlab.kernels.arch import DeviceFacts, Peaks


def test_cpu_timing_measures_the_call_and_labels_it():
    calls = []
    t = bench(lambda: time.sleep(0.002), device="cpu", warmup=1, repeats=5,
              setup=lambda i: calls.append(i))
    assert t.kind == "cpu" and t.repeats == 5
    assert 2.0 <= t.min_ms <= t.p10_ms <= t.median_ms <= t.p90_ms
    assert t.median_ms < 50
    assert calls == [0, 0, 1, 2, 3, 4]  # setup(i) before each warm-up and timed call
    assert math.isclose(t.seconds, t.median_ms / 1e3)
    assert set(t.as_dict()) >= {"median_ms", "p10_ms", "p90_ms", "kind"}


def test_cpu_timing_stops_at_max_seconds():
    t = bench(lambda: time.sleep(0.02), device="cpu", warmup=1, repeats=1000, max_seconds=0.1)
    assert 3 <= t.repeats < 20


def test_quantiles():
    t = _quantiles([float(v) for v in range(1, 12)], "cpu")  # 1..11
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.min_ms, t.mean_ms) == (6.0, 2.0, 10.0, 1.0, 6.0)
    assert isinstance(t, Timing)


def test_cosine_error():
    x = torch.randn(100, dtype=torch.float64)
    assert cosine_error(x, x) == pytest.approx(0.0, abs=1e-15)
    assert cosine_error(x, -x) == pytest.approx(2.0)
    assert cosine_error(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(1.0)
    assert cosine_error(torch.zeros(3), torch.zeros(3)) == 0.0
    # FlashMLA's 1e-5 bar separates bf16 rounding from a real bug
    xb = torch.randn(4096)
    assert cosine_error(xb, xb.bfloat16()) < 1e-5
    assert cosine_error(xb, xb + 0.01 * torch.randn(4096)) > 1e-5
    assert math.isnan(cosine_error(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0])))


FACTS = DeviceFacts("Test GPU", "sm90", 132, 1 << 37, Peaks(4e12, 1e15, 2e15, 0.0, "test"))


def test_roofline_memory_and_compute_bound():
    r = roofline(flops=0, nbytes=4e9, seconds=2e-3, facts=FACTS)  # 2 TB/s of 4: half the roofline
    assert r["gbps"] == pytest.approx(2000.0) and r["bound"] == "memory"
    assert r["pct_roofline"] == pytest.approx(50.0) and r["floor_us"] == pytest.approx(1000.0)
    r = roofline(flops=1e12, nbytes=1e6, seconds=4e-3, facts=FACTS)  # 250 TFLOPS of 1000
    assert r["tflops"] == pytest.approx(250.0) and r["bound"] == "compute"
    assert r["pct_roofline"] == pytest.approx(25.0)
    assert r["intensity"] == pytest.approx(1e6)
    r = roofline(flops=1e12, nbytes=1e6, seconds=4e-3, facts=FACTS, compute_dtype="fp8")
    assert r["pct_roofline"] == pytest.approx(12.5)
    assert FACTS.peaks.ridge("bf16") == pytest.approx(250.0)


def test_roofline_without_peaks():
    r = roofline(1e9, 1e9, 1e-3, DeviceFacts("cpu", "cpu", 2, 0, None))
    assert r["gbps"] == pytest.approx(1000.0) and r["bound"] == "?" and math.isnan(r["pct_roofline"])


def test_reference_checked_compares_each_call_and_keeps_the_backends_result(tmp_path):
    from pdlab.bench.harness import reference_checked
    from pdlab.kernels.registry import get_backend, register_backend

    op = "harness_checked_toy"

    @register_backend(op, "ref", archs=("cpu",), reference=True)
    def ref(x, *, scale=1.0, config=None):
        return x.double() * scale, x.sum()

    n = {"calls": 0}

    @register_backend(op, "fast", archs=("cpu",), default_config={"k": 1})
    def fast(x, *, scale=1.0, config=None):
        n["calls"] += 1
        y = x * scale
        if n["calls"] == 2:  # wrong on its second call only
            y = y.flip(0)
        return y, x.sum()

    x = torch.randn(64)
    with reference_checked(op, "fast", dump_dir=str(tmp_path)) as calls:
        a = get_backend(op, "fast").impl(x, scale=2.0, config={"k": 3})
        b = get_backend(op, "fast").impl(x, scale=2.0, config={"k": 3})
    torch.testing.assert_close(a[0], x * 2.0)
    torch.testing.assert_close(b[0], (x * 2.0).flip(0))  # the backend's own result, not the reference's
    assert [c["call"] for c in calls] == [0, 1] and calls[0]["config"] == {"k": 3}
    assert calls[0]["errors"][0] < 1e-12 and calls[1]["errors"][0] > 0.1 and calls[1]["errors"][1] < 1e-12
    assert "dump" not in calls[0] and torch.load(calls[1]["dump"])["kwargs"] == {"scale": 2.0}
    assert get_backend(op, "fast").impl is fast  # unwrapped after the block


@pytest.mark.gpu
def test_graph_timing_of_an_uncapturable_call_leaves_the_next_trials_working():
    # the tuner times each trial in a CUDA graph and falls back to eager timing when the call cannot be captured;
    # the failed capture must not break what comes after it (new random inputs, the next graph timing)
    x = torch.ones(1024, device="cuda")
    with pytest.raises(RuntimeError):
        bench(lambda: (x * 2).sum().item(), device="cuda", warmup=1, repeats=3, cuda_graph=True, graph_calls=2)
    eager = bench(lambda: (x * 2).sum().item(), device="cuda", warmup=1, repeats=3)
    assert eager.median_ms > 0
    y = torch.randn(1 << 16, device="cuda")  # a random input of the next trial
    t = bench(lambda: torch.mul(y, 2), device="cuda", warmup=1, repeats=3, cuda_graph=True, graph_calls=2)
    assert t.kind == "cuda-graph" and t.median_ms > 0


def test_roofline_of_fp32_work_uses_the_fp32_peak_not_the_bf16_tensor_cores():
    # an fp32 row's compute floor was taken at the bf16 tensor-core rate (16x the fp32 one on H100/H200)
    facts = DeviceFacts("Test GPU", "sm90", 132, 1 << 37, Peaks(4e12, 1e15, 2e15, 0.0, "test", fp32_flops=5e13))
    r = roofline(flops=1e12, nbytes=1e6, seconds=40e-3, facts=facts, compute_dtype="fp32")  # 25 TFLOPS of 50
    assert r["bound"] == "compute" and r["pct_roofline"] == pytest.approx(50.0)
    assert r["compute_peak"] == "fp32 CUDA cores (no TF32)"
    assert roofline(1e12, 1e6, 40e-3, facts, "bf16")["pct_roofline"] == pytest.approx(2.5)
    # no fp32 figure: no compute floor to claim (the memory one alone would call it memory-bound)
    r = roofline(flops=1e12, nbytes=1e6, seconds=40e-3, facts=FACTS, compute_dtype="fp32")
    assert r["bound"] == "?" and math.isnan(r["pct_roofline"])


def test_every_datasheet_device_has_an_fp32_peak_below_its_bf16_one():
    from pdlab.kernels.arch import peaks_table

    for name, peaks in peaks_table().items():
        assert 0 < peaks.fp32_flops < peaks.bf16_flops / 2, name


def test_peaks_cached_before_fp32_was_measured_take_it_from_the_datasheet_ratio(tmp_path, monkeypatch):
    import json

    from pdlab.kernels.arch import measured_peaks, peaks_table

    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path))
    (tmp_path / "measured_peaks.json").write_text(json.dumps({"NVIDIA H200": {
        "hbm_bytes_per_s": 4.2e12, "bf16_flops": 7e14, "fp8_flops": 1.4e15, "fp4_flops": 0.0, "source": "old"}}))
    sheet = peaks_table()["H200"]
    assert measured_peaks("NVIDIA H200").fp32_flops == pytest.approx(7e14 * sheet.fp32_flops / sheet.bf16_flops)


def test_a_tflops_plot_draws_the_peak_of_each_unit_its_rows_ran_on(tmp_path, monkeypatch):
    """bench attention's TFLOPS plot drew the bf16 tensor-core peak over fp32 rows too (15x theirs): one line per
    distinct `compute_peak` of the plotted rows, at that unit's rate."""
    import matplotlib.axes
    import pandas as pd

    from pdlab.bench import report
    from pdlab.bench.roofline import PEAK_LABELS, peak_lines

    peaks = Peaks(4e12, 1e15, 2e15, 0.0, "test", fp32_flops=5e13)
    labels = [PEAK_LABELS["fp32"], None, float("nan"), PEAK_LABELS["bf16"], PEAK_LABELS["fp32"]]
    assert peak_lines(peaks, labels) == [(50.0, "fp32 CUDA cores (no TF32) peak"), (1000.0, "bf16 tensor cores peak")]
    assert peak_lines(None, labels) == [] and peak_lines(peaks, [None]) == []
    assert peak_lines(Peaks(4e12, 1e15, 2e15, 0.0, "test"), [PEAK_LABELS["fp32"]]) == []  # fp32 rate unknown
    drawn = []
    real = matplotlib.axes.Axes.axhline
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline",
                        lambda self, y, **kw: (drawn.append((y, kw.get("label"))), real(self, y, **kw))[1])
    df = pd.DataFrame({"shape": ["a", "b"], "label": ["x", "x"], "tflops": [1.0, 2.0]})
    png = report.plot_bars(df, "shape", "tflops", "label", tmp_path / "t.png", "t", "TFLOPS",
                           hline=7.0, hline_label="one", hlines=peak_lines(peaks, labels))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert drawn == [(7.0, "one"), (50.0, "fp32 CUDA cores (no TF32) peak"), (1000.0, "bf16 tensor cores peak")]
