"""`bench quantize`, `bench list`, `bench contracts` run end to end on this machine (CPU here)."""

import argparse
import json

import pandas as pd

from pdlab.bench import contracts, doctor, quantize
from pdlab.kernels import registry


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_bench_quantize_writes_results_and_says_which_ran(tmp_path, capsys):
    args = _args(quantize, ["--m", "1", "8", "--k", "64", "--grouped", "2,4", "--repeats", "3",
                            "--out", str(tmp_path), "--no-plot"])
    assert quantize.run(args) == 0
    out = capsys.readouterr().out
    assert "backends that ran: torch" in out
    df = pd.read_csv(tmp_path / "quantize.csv")
    torch_rows = df[df.backend == "torch"]
    assert sorted(torch_rows["shape"]) == ["[1, 64]", "[2, 4, 64] masked", "[8, 64]"]
    assert (torch_rows["status"] == "ok").all() and (torch_rows["time_us"] > 0).all()
    row = torch_rows[torch_rows["shape"] == "[8, 64]"].iloc[0]
    assert row["bytes"] == 8 * 64 * 2 + 8 * (32 + 4)  # bf16 read + packed + scales written
    meta = json.loads((tmp_path / "quantize.json").read_text())["meta"]
    assert meta["device"] and meta["dtype"] == "bf16"
    triton_rows = df[df.backend == "triton"]
    reason = registry.unavailable_reason("nvfp4_quantize", "triton")
    if reason:  # plain CPU: skipped, with the reason printed
        assert (triton_rows["status"] == "skipped").all()
        assert reason in out
    else:  # GPU, or the interpreter enabled by the environment: it ran and matched the reference
        assert (triton_rows["status"] == "ok").all()
        assert triton_rows["bit_exact"].astype(str).eq("True").all()


def test_bench_quantize_unknown_backend_is_an_error_that_names_the_registered_ones(tmp_path, capsys):
    args = _args(quantize, ["--m", "1", "--k", "32", "--grouped", "none", "--backends", "torch,nope",
                            "--out", str(tmp_path), "--no-plot", "--repeats", "2"])
    assert quantize.run(args) == 2
    out = capsys.readouterr().out
    assert "nvfp4_quantize has no backend named 'nope'; registered: " in out and "triton" in out
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_bench_list_shows_the_matrix(capsys):
    assert doctor.run(_args(doctor, [])) == 0
    out = capsys.readouterr().out
    assert "nvfp4_quantize" in out and "torch (reference)" in out and "arch" in out
    assert doctor.run(_args(doctor, ["--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {(r["op"], r["backend"]): r for r in data["backends"]}
    assert rows[("nvfp4_quantize", "torch")]["available"]


def test_bench_list_reports_import_errors(tmp_path, monkeypatch):
    pkg = tmp_path / "brokenops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("X = 1\n")
    (pkg / "bad.py").write_text("import surely_not_installed_pkg_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    errors = doctor.import_op_packages(("brokenops", "pdlab.no_such_package"))
    assert set(errors) == {"brokenops.bad", "pdlab.no_such_package"}
    assert "surely_not_installed_pkg_xyz" in errors["brokenops.bad"]


def test_bench_contracts_reports_overhead(capsys):
    assert contracts.run(_args(contracts, ["--calls", "200"])) == 0
    out = capsys.readouterr().out
    assert "5-tensor check:" in out and "us per call" in out
    op, tensors = contracts.five_tensor_op(), contracts.five_tensors()
    assert op.check("x", **tensors) == {"E": 32, "M": 128, "K": 7168, "I": 2048}


def test_bench_attention_config_words():
    # "default" forces the backend default past a tuned entry, "tuned" (and no --config) looks one up,
    # anything else must be a JSON object: a typo is an error that says so, not a silent default row
    import pytest

    from pdlab.bench.attention import parse_configs

    assert parse_configs([]) == [None]
    assert parse_configs(["default", "tuned", '{"BLOCK_N": 32}']) == ["default", None, {"BLOCK_N": 32}]
    with pytest.raises(SystemExit, match="neither JSON nor 'default'/'tuned'"):
        parse_configs(["defualt"])
    with pytest.raises(SystemExit, match="must be a JSON object"):
        parse_configs(["[1, 2]"])


def test_bench_shape_options_reject_bad_values_with_a_usage_error(capsys):
    # tried as a new user would: --batch 0 used to end in a traceback from max(), --page-size 3 in a
    # ShapeError traceback, --dispatch int4 in an empty CSV with exit 0
    import pytest

    from pdlab.bench.cli import main

    bad = [(["attention", "--batch", "0"], "argument --batch: '0' is below 1"),
           (["attention", "--seqlen", "1k"], "argument --seqlen: '1k' is not an integer"),
           (["attention", "--page-size", "16,3"], "argument --page-size: '3' is not a power of two in 1..128"),
           (["attention", "--page-size", "256"], "'256' is not a power of two in 1..128"),
           (["attention", "--kv-dtype", "bf16,fp4"], "'fp4' is not one of bf16, fp16, fp32, fp8"),
           (["attention", "--s-q", ","], "argument --s-q: empty list"),
           (["attention", "--op", "prefill", "--new-tokens", "-1"], "argument --new-tokens: '-1' is below 0"),
           (["moe", "--tokens", "1,0"], "argument --tokens: '0' is below 1"),
           (["moe", "--dispatch", "int4"], "'int4' is not one of nvfp4, fp8, bf16"),
           (["moe", "--ep", "0"], "argument --ep: '0' is below 1")]
    for argv, message in bad:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    from pdlab.bench import attention, moe

    args = _args(attention, ["--batch", "1,32", "--page-size", "1,64,128", "--kv-dtype", "fp8"])
    assert (args.batch, args.page_size, args.kv_dtype) == ("1,32", "1,64,128", "fp8")  # the text, split later
    assert _args(moe, []).dispatch == "nvfp4" and _args(moe, ["--ep", "4"]).ep == 4


def test_a_backend_name_nobody_registered_is_an_error_not_an_unavailable_row(tmp_path, capsys):
    # tried as a new user would: `bench attention --backend flashmal` listed the typo as "unavailable", measured the
    # rest and exited 0, as did `bench moe --runner` with a typo (every row skipped)
    from pdlab.bench.cli import main

    assert main(["attention", "--backend", "torch,flashmal", "--batch", "1", "--seqlen", "64", "--heads", "16",
                 "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "mla_decode has no backend named 'flashmal'; registered: flashinfer, flashmla, torch, triton" in out
    assert not list(tmp_path.iterdir())
    assert registry.unknown_names("mla_decode", ["torch", "triton"]) is None


def test_bench_attention_prefill_runs_with_the_default_backends(tmp_path, capsys):
    # tried as a new user would: `bench attention --op prefill` exited 2 at once, its default backend list being
    # decode's (flashmla and trtllm_mla have no prefill)
    from pdlab.bench.cli import main

    assert main(["attention", "--op", "prefill", "--batch", "1", "--seqlen", "64", "--heads", "16",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no backend named" not in out and "mla_prefill" in out
    rows = pd.read_csv(next(tmp_path.glob("*.csv")))
    assert "torch" in set(rows["backend"]) and not {"flashmla", "trtllm_mla"} & set(rows["backend"])
