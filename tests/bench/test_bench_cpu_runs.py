"""`bench attention`, `bench moe` and `bench quantize` run at small shapes on CPU as a new user would: rows are
what they say they are, lists of names and a model config are checked before measuring, and the CSV has the same
columns whatever ran."""

import pandas as pd
import pytest
import torch

from pdlab.bench.cli import main


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("kv_dtype, cache_dtype, op", [("fp32", torch.float32, "decode"),
                                                       ("fp16", torch.float16, "decode"),
                                                       ("fp32", torch.float32, "prefill")])
def test_bench_attention_runs_the_cache_dtype_its_rows_name(tmp_path, monkeypatch, kv_dtype, cache_dtype, op):
    # --kv-dtype fp32 ran a bf16 cache (and counted 2 bytes per element) in rows labelled fp32
    import pdlab.attention as attention

    seen = []
    name = f"mla_{op}"
    real = getattr(attention, name)

    def spy(q, kv_cache, *args, **kwargs):
        seen.append((q.dtype, kv_cache.dtype))
        return real(q, kv_cache, *args, **kwargs)

    monkeypatch.setattr(attention, name, spy)
    assert main(["attention", "--op", op, "--backend", "torch", "--batch", "1", "--seqlen", "16",
                 "--kv-dtype", kv_dtype, "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert seen and set(seen) == {(cache_dtype, cache_dtype)}
    row = pd.read_csv(tmp_path / f"{name}.csv").iloc[0]
    assert row["kv_dtype"] == kv_dtype and row["status"] == "ok"


@pytest.mark.parametrize("kv_dtypes", ["bf16,,", "bf16, fp16", ",bf16"])
def test_bench_attention_kv_dtype_list_is_read_as_its_check_reads_it(tmp_path, capsys, kv_dtypes):
    # the list passed its check (which skips blanks and spaces) and was then split again without them: rows of
    # "unsupported: kv cache dtype  not in (...)" for an empty dtype, and " fp16" with a space
    assert main(["attention", "--backend", "torch", "--batch", "1", "--seqlen", "16", "--kv-dtype", kv_dtypes,
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "mla_decode.csv")
    assert df["status"].eq("ok").all(), df["status"].tolist()
    assert df["kv_dtype"].tolist() == [t.strip() for t in kv_dtypes.split(",") if t.strip()]


@pytest.mark.parametrize("argv, flag", [(["attention", "--backend", ","], "--backend"),
                                        (["attention", "--backend", " "], "--backend"),
                                        (["quantize", "--backends", ",,", "--grouped", "none"], "--backends")])
def test_an_empty_backend_list_is_a_usage_error(tmp_path, capsys, argv, flag):
    # bench attention --backend , exited 1 saying "reasons above" with no reason above; bench quantize
    # --backends , ended in a KeyError: 'status' traceback
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and f"argument {flag}: empty list" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, csv, key", [
    (["attention", "--backend", "torch,torch", "--batch", "1", "--seqlen", "16"], "mla_decode.csv", "backend"),
    (["quantize", "--backends", "torch,torch", "--m", "1", "--k", "32", "--grouped", "none", "--no-plot"],
     "quantize.csv", "backend"),
    (["moe", "--runner", "torch,torch", "--mode", "normal", "--tokens", "1", "--no-plot"], "moe_ep1.csv", "runner"),
    (["moe", "--dispatch", "bf16,bf16", "--mode", "normal", "--tokens", "1", "--no-plot"], "moe_ep1.csv", "payload"),
    (["moe", "--tokens", "1,1", "--mode", "normal", "--no-plot"], "moe_ep1.csv", "tokens"),
    (["attention", "--batch", "1,1", "--backend", "torch", "--seqlen", "16"], "mla_decode.csv", "batch"),
    (["quantize", "--m", "1", "1", "--backends", "torch", "--k", "32", "--grouped", "none", "--no-plot"],
     "quantize.csv", "M"),
])
def test_a_name_given_twice_runs_once(tmp_path, argv, csv, key):
    # each repeated name measured its rows again: the CSV held the same configuration twice
    assert main([*argv, "--repeats", "1", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / csv)
    assert len(df) == 1 and df[key].astype(str).tolist() == [argv[2].split(",")[0]]


def test_bench_moe_auto_and_the_runner_it_picks_on_cpu_run_once(tmp_path):
    # on CPU auto is the torch runner: --runner auto,torch measured the torch rows twice
    if torch.cuda.is_available():
        pytest.skip("auto picks the best GPU runner there")
    assert main(["moe", "--runner", "auto,torch", "--mode", "normal", "--tokens", "1", "--repeats", "1",
                 "--no-plot", "--out", str(tmp_path)]) == 0
    assert pd.read_csv(tmp_path / "moe_ep1.csv")["runner"].tolist() == ["torch"]


@pytest.mark.parametrize("model", ["{tmp}/missing/config.json", "{tmp}/config.json", "./nope.json"])
def test_bench_moe_model_path_that_does_not_exist_says_so(tmp_path, capsys, model):
    # said "unknown model '.../config.json': use one of deepseek-r1, deepseek-v3 or a path to ...", as if the path
    # had been taken for a misspelt model name
    model = model.format(tmp=tmp_path)
    assert main(["moe", "--model", model, "--tokens", "1", "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith(f"bench moe: --model {model!r}") and "no such file" in line and "unknown model" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("hidden, inter, field", [(100, 64, "hidden_size=100"), (256, 72, "moe_intermediate_size=72")])
def test_bench_moe_model_sizes_nvfp4_cannot_hold_are_a_usage_error(tmp_path, capsys, hidden, inter, field):
    # a config whose hidden size is not a multiple of NVFP4's 16-element blocks ended in a ShapeError traceback
    # from building the benchmark's NVFP4 expert weights
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": hidden, "n_routed_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": inter}))
    assert main(["moe", "--model", str(cfg), "--tokens", "1", "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith(f"bench moe: --model {str(cfg)!r}") and field in line and "multiple of 16" in line
    assert not (tmp_path / "out").exists()


def test_bench_moe_scaling_with_an_out_that_is_a_file_exits_2(tmp_path, capsys):
    # the plot was drawn, then saving it ended in a FileExistsError traceback
    assert main(["moe", "--mode", "normal", "--tokens", "1", "--repeats", "1", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    target = tmp_path / "plots"
    target.write_text("x\n")
    assert main(["moe", "--scaling", str(tmp_path / "moe_ep1.csv"), "--out", str(target)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith(f"bench moe --scaling: --out {target}") and "not a folder" in line
    assert target.read_text() == "x\n"


def test_bench_moe_csv_has_the_same_columns_whatever_ran(tmp_path):
    # the columns followed the rows: --no-reference dropped cos_err (the help says "error column empty"), a run
    # where every row was skipped wrote 8 columns (so --scaling called its CSV "not a result CSV of bench moe"),
    # and EP1 had a rank column that EP2 had not
    common = ["--mode", "normal", "--tokens", "1", "--repeats", "1", "--warmup", "0", "--no-plot"]
    runs = {"ok": [], "no_reference": ["--no-reference"], "skipped": ["--dispatcher", "deepep"],
            "ep2": ["--ep", "2"]}
    columns = {}
    for name, extra in runs.items():
        out = tmp_path / name
        code = main(["moe", *common, *extra, "--out", str(out)])
        df = pd.read_csv(next(out.glob("moe_ep?.csv")))
        assert code == (1 if name == "skipped" and _unavailable("moe_dispatch", "deepep") else 0)
        columns[name] = list(df.columns)
    assert all(cols == columns["ok"] for cols in columns.values()), columns
    assert "cos_err" in columns["ok"] and "dispatch_GBps" in columns["ok"] and "rank" not in columns["ok"]


def _unavailable(op: str, backend: str) -> bool:
    import pdlab.moe.dispatch  # noqa: F401  (registers the dispatchers)
    from pdlab.kernels import registry

    return registry.unavailable_reason(op, backend) is not None


def test_bench_attention_csv_has_the_same_columns_when_rows_fail(tmp_path, monkeypatch, capsys):
    # a run whose rows all failed wrote only the shape, backend, status and config columns
    from pdlab.bench import attention

    argv = ["attention", "--backend", "torch", "--batch", "1", "--seqlen", "16", "--repeats", "1"]
    assert main([*argv, "--out", str(tmp_path / "ok")]) == 0

    def broken(*args):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(attention, "_kernel", broken)
    assert main([*argv, "--out", str(tmp_path / "failed")]) == 1
    ok, failed = (pd.read_csv(tmp_path / run / "mla_decode.csv") for run in ("ok", "failed"))
    assert list(failed.columns) == list(ok.columns)
    assert failed["status"].str.contains("kernel failed").all() and failed["median_ms"].isna().all()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[error"))
    assert line.endswith("torch") and "nan" not in line


def test_bench_quantize_csv_has_the_same_columns_whatever_ran(tmp_path, monkeypatch):
    # a run where every backend was skipped wrote 9 columns, one where torch ran 17
    from pdlab.bench import quantize

    common = ["quantize", "--m", "1", "--k", "32", "--grouped", "none", "--backends", "torch", "--repeats", "1",
              "--no-plot"]
    assert main([*common, "--out", str(tmp_path / "ok")]) == 0
    monkeypatch.setattr(quantize, "_reason", lambda registry, name: "not on this machine")
    assert main([*common, "--out", str(tmp_path / "skipped")]) == 1
    ok, skipped = (pd.read_csv(tmp_path / run / "quantize.csv") for run in ("ok", "skipped"))
    assert list(skipped.columns) == list(ok.columns) and "time_us" in ok.columns and "reason" in ok.columns
    assert skipped["status"].eq("skipped").all() and skipped["time_us"].isna().all()


def test_bench_moe_buffer_smaller_than_the_low_latency_tokens_is_a_usage_error(tmp_path, capsys):
    # every low-latency row was measured as "skipped: ... buffer holds num_max_dispatch_tokens_per_rank=1" (exit 1)
    assert main(["moe", "--mode", "low_latency", "--tokens", "4", "--num-max-dispatch-tokens", "1",
                 "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench moe: --num-max-dispatch-tokens 1") and "4 tokens" in line
    assert not (tmp_path / "out").exists()


def test_bench_moe_merged_ep_row_takes_each_expert_rate_from_the_ranks_alike():
    # the merged row's tflops and pct_roofline were the worst rank's but experts_GBps stayed rank 0's, so the three
    # expert figures of one row described different ranks (here rank 1 streamed 40 MB in 10 ms: 4 GB/s, not 10)
    from pdlab.bench.moe import _merge_ranks

    def rank_row(rank, experts_ms, experts_mb, tflops):
        return dict(mode="normal", tokens=16, payload="nvfp4", runner="torch", rank=rank, status="ok",
                    dispatch_ms=1.0, combine_ms=1.0, experts_ms=experts_ms, total_ms=5.0, dispatch_MB=1.0,
                    combine_MB=1.0, pairs=8, cos_err=0.01, tflops=tflops,
                    experts_GBps=experts_mb / 1e3 / (experts_ms / 1e3), pct_roofline=float("nan"))

    (row,) = _merge_ranks([[rank_row(0, 2.0, 20.0, 0.5)], [rank_row(1, 10.0, 40.0, 0.2)]])
    assert row["experts_ms"] == 10.0 and row["tflops"] == 0.2
    assert row["experts_GBps"] == pytest.approx(4.0)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_bench_attention_counts_q_and_out_bytes_at_the_dtype_the_row_ran(tmp_path, op):
    # an fp32 row's GB/s counted q and the output at 2 bytes an element (bf16's) though they ran at 4
    from pdlab.attention.workloads import decode_cost, prefill_cost

    assert main(["attention", "--op", op, "--backend", "torch", "--batch", "2", "--seqlen", "32", "--heads", "16",
                 "--kv-dtype", "fp32,bf16,fp8", "--page-size", "16", "--repeats", "1", "--no-reference",
                 "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / f"mla_{op}.csv").set_index("kv_dtype")
    for kv_dtype, kv_elem, q_elem in (("fp32", 4, 4), ("bf16", 2, 2), ("fp8", 1, 2)):  # fp8 rows run bf16 q
        row = df.loc[kv_dtype]
        assert row["status"] == "ok"
        if op == "decode":
            nbytes = decode_cost(2, 1, 16, 64, kv_elem, q_elem)[1]
        else:
            nbytes = prefill_cost([32, 32], [32, 32], 16, kv_elem, q_elem)[1]
        assert row["gbps"] * 1e9 * row["median_ms"] / 1e3 == pytest.approx(nbytes, rel=1e-6), kv_dtype


@pytest.mark.parametrize("dispatch", ["fp8", "bf16,fp8"])
def test_bench_moe_fp8_dispatch_of_a_hidden_size_fp8_cannot_hold_is_a_usage_error(tmp_path, capsys, dispatch):
    # hidden 144 (a multiple of NVFP4's 16, not of fp8's 128-element scale blocks): every fp8 row was skipped at run
    # time and the run exited 0 with the bf16 rows alone
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 144, "n_routed_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1}))
    assert main(["moe", "--model", str(cfg), "--dispatch", dispatch, "--tokens", "1", "--out", str(tmp_path / "out"),
                 "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench moe: --dispatch fp8") and "hidden_size=144" in line and "multiple of 128" in line
    assert not (tmp_path / "out").exists()


def _peaks_here(monkeypatch):
    """Pretend this CPU has datasheet peaks (fp32 far below bf16), so that rows report a roofline."""
    from pdlab.kernels import arch

    facts = arch.DeviceFacts("Test GPU", "cpu", 2, 1 << 34,
                             arch.Peaks(1e12, 1e12, 2e12, 0.0, "test", fp32_flops=1e9))
    monkeypatch.setattr(arch, "device_facts", lambda device=None: facts)
    return facts.peaks


def _expected_pct(row, peak_flops: float, peaks) -> float:
    # floor / time = max(flops / peak, bytes / bandwidth) / time
    return 100 * max(row["tflops"] * 1e12 / peak_flops, row["gbps"] * 1e9 / peaks.hbm_bytes_per_s)


def test_bench_attention_fp32_rows_take_the_fp32_peak(tmp_path, capsys, monkeypatch):
    # fp32 rows' % roofline was computed against the bf16 tensor-core peak
    peaks = _peaks_here(monkeypatch)
    assert main(["attention", "--backend", "torch", "--batch", "1", "--seqlen", "64", "--heads", "16", "--kv-dtype",
                 "fp32,bf16", "--repeats", "1", "--out", str(tmp_path), "--no-plot"]) == 0
    df = pd.read_csv(tmp_path / "mla_decode.csv").set_index("kv_dtype")
    assert df.loc["fp32", "compute_peak"] == "fp32 CUDA cores (no TF32)"
    assert df.loc["bf16", "compute_peak"] == "bf16 tensor cores"
    assert df.loc["fp32", "pct_roofline"] == pytest.approx(_expected_pct(df.loc["fp32"], peaks.fp32_flops, peaks))
    assert df.loc["bf16", "pct_roofline"] == pytest.approx(_expected_pct(df.loc["bf16"], peaks.bf16_flops, peaks))


def test_bench_moe_reference_runner_rows_take_the_fp32_peak(tmp_path, capsys, monkeypatch):
    # the torch runner computes in fp32; its experts' % roofline was computed against the bf16 tensor-core peak
    peaks = _peaks_here(monkeypatch)
    assert main(["moe", "--runner", "torch", "--dispatch", "bf16", "--mode", "normal", "--tokens", "16",
                 "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--no-plot"]) == 0
    row = pd.read_csv(tmp_path / "moe_ep1.csv").iloc[0]
    assert row["compute_peak"] == "fp32 CUDA cores (no TF32)"
    assert row["pct_roofline"] == pytest.approx(100 * max(row["tflops"] * 1e12 / peaks.fp32_flops,
                                                          row["experts_GBps"] * 1e9 / peaks.hbm_bytes_per_s))


def test_each_moe_runner_names_the_units_its_roofline_takes():
    # the compute peak comes from each runner's registry option `compute`: fp32 reference, fp4 cutedsl, bf16 else
    import pdlab.moe  # noqa: F401  (registers the runners)
    from pdlab.bench import moe as bench_moe

    got = {r: bench_moe._compute_dtype(r) for r in ("torch", "cutedsl", "triton", "torch_grouped", "nobody")}
    assert got == {"torch": "fp32", "cutedsl": "fp4", "triton": "bf16", "torch_grouped": "bf16", "nobody": "bf16"}
