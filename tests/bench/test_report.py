"""Report helpers: CSV + provenance JSON, rich table, plots, default output folder."""

import json

import pandas as pd

from pdlab.bench import report
from pdlab.kernels.arch import DeviceFacts, Peaks


def test_save_writes_csv_and_json_with_provenance(tmp_path):
    df = pd.DataFrame({"backend": ["torch", "triton"], "gbps": [1.5, float("nan")]})
    facts = DeviceFacts("Test GPU", "sm90", 132, 0, Peaks(4e12, 1e15, 2e15, 0, "sheet"))
    meta = report.provenance(facts, {"note": "x"})
    assert meta["device"] == "Test GPU" and meta["peaks_source"] == "sheet" and meta["note"] == "x"
    assert meta["commit"] and meta["date"].endswith("Z")
    path = report.save(df, tmp_path / "out", "quantize", meta)
    assert path == tmp_path / "out" / "quantize.csv"
    assert pd.read_csv(path)["backend"].tolist() == ["torch", "triton"]
    payload = json.loads((tmp_path / "out" / "quantize.json").read_text())
    assert payload["meta"]["device"] == "Test GPU"
    assert payload["rows"][0] == {"backend": "torch", "gbps": 1.5} and payload["rows"][1]["gbps"] is None


def test_print_table_and_progress(capsys):
    df = pd.DataFrame({"shape": ["[1, 16]"], "time_us": [12.3456], "pct": [float("nan")]})
    report.print_table(df, "title here")
    out = capsys.readouterr().out
    assert "title here" in out and "12.3" in out and "nan" not in out
    seen = []
    with report.progress(2, "work") as advance:
        advance("a")
        advance()
        seen.append(1)
    assert seen == [1]


def test_print_table_keeps_long_labels_whole(capsys):
    # tune's summary: labels without spaces were cut with "…" at the header's width, so rows that differ only in
    # their last keys (the payload here) looked alike
    shapes = [f"tokens_per_rank={t},mode=low_latency,payload={p}" for t in (16, 128) for p in ("bf16", "nvfp4")]
    df = pd.DataFrame({"op": ["moe_dispatch"] * 4, "shape": shapes, "backend": ["local"] * 4,
                       "default_ms": [1.0] * 4, "tuned_ms": [0.5] * 4, "speedup": [2.0] * 4, "trials": [6] * 4,
                       "failed": [3] * 4, "note": ["passed over the fastest: wrong at an edge shape"] * 4})
    report.print_table(df, "tuning on cpu")
    out = capsys.readouterr().out
    assert "…" not in out
    column = "".join(line.split("│")[2].strip() for line in out.splitlines() if line.startswith("│"))
    assert column == "".join(shapes)


def test_progress_off_a_terminal_prints_plain_lines(monkeypatch):
    """Redirected to a file (a GPU box under nohup, CI), a rich bar shows nothing until the end: the progress prints
    a plain line at most every every_s seconds and at the last step, with the note (e.g. the best time so far)."""
    import io
    import types

    clock = iter([0.0, 1.0, 12.0, 13.0, 14.0, 20.0, 21.0])  # enter, then one reading per call
    monkeypatch.setattr(report, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    out = io.StringIO()  # not a terminal
    with report.ProgressBar(3, "tune op", stream=out) as bar:
        bar.advance(1, "first")  # 1 s: quiet
        bar.note("best 1.5 ms")  # 12 s: a line
        bar.advance()  # 13 s: quiet
        bar.advance()  # 14 s: the last step, a line
    assert out.getvalue().splitlines() == ["tune op: 1/3 in 12 s  best 1.5 ms", "tune op: 3/3 in 14 s  best 1.5 ms"]
    quiet = io.StringIO()
    with report.ProgressBar(1, "x", enabled=False, stream=quiet) as bar:
        bar.advance()
    assert quiet.getvalue() == ""


def test_plots_are_written(tmp_path):
    df = pd.DataFrame({"shape": ["a", "a", "b", "b"], "backend": ["torch", "triton"] * 2,
                       "gbps": [1.0, 3.0, 2.0, 4.0], "route": [1, 2, 3, 4], "gemm": [4, 3, 2, 1]})
    bars = report.plot_bars(df, "shape", "gbps", "backend", tmp_path / "p" / "bars.png", "t", "GB/s",
                            hline=5.0, hline_label="peak")
    assert bars.exists() and bars.read_bytes()[:4] == b"\x89PNG"
    stacked = report.plot_stacked(df[df.backend == "torch"], "shape", ["route", "gemm"], tmp_path / "s.png", "t", "us")
    assert stacked.stat().st_size > 1000


def test_default_out_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PDLAB_RESULTS_DIR", str(tmp_path))
    from pdlab.kernels.arch import device_facts

    assert report.default_out_dir("quantize") == tmp_path / device_facts().key / "quantize"


def test_git_commit_names_pdlab_commit_when_set(monkeypatch):
    """A working tree copied onto another machine beside an older .git names its own commit through PDLAB_COMMIT;
    without it, the checkout's git answers (a short hash, possibly -dirty)."""
    from pdlab.bench import report

    monkeypatch.setenv("PDLAB_COMMIT", "abc1234")
    assert report.git_commit() == "abc1234" and report.provenance()["commit"] == "abc1234"
    monkeypatch.delenv("PDLAB_COMMIT")
    assert report.git_commit() != "abc1234"
