"""`bench` as a new user drives it with odd input: every bad value ends in one line naming what was wrong
(exit 2 for usage errors), never a traceback; a run where nothing ran does not exit 0."""

import json

import pandas as pd
import pytest

from pdlab.bench.cli import main


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("content, says", [
    ("[1, 2, 3]", "JSON object"),
    ('{"hidden_size": 512, "n_routed_experts": null, "num_experts_per_tok": 2, "moe_intermediate_size": 256}',
     "n_routed_experts"),
])
def test_bench_moe_model_config_of_the_wrong_form_exits_2(tmp_path, capsys, content, says):
    # tried as a new user would: a config.json holding a JSON array ended in AttributeError, one with a null
    # field in TypeError, both as tracebacks
    cfg = tmp_path / "config.json"
    cfg.write_text(content)
    assert main(["moe", "--model", str(cfg), "--tokens", "1", "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench moe: --model") and str(cfg) in line and says in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, says", [
    (["moe", "--repeats", "0"], "argument --repeats: '0' is below 1"),
    (["moe", "--repeats", "-1"], "argument --repeats: '-1' is below 1"),
    (["moe", "--warmup", "-1"], "argument --warmup: '-1' is below 0"),
    (["moe", "--num-max-dispatch-tokens", "-4"], "argument --num-max-dispatch-tokens: '-4' is below 1"),
    (["moe", "--timeout", "0"], "argument --timeout: '0' is not a number of seconds > 0"),
    (["attention", "--repeats", "0"], "argument --repeats: '0' is below 1"),
    (["attention", "--max-seconds", "-1"], "argument --max-seconds: '-1' is not a number of seconds > 0"),
    (["quantize", "--repeats", "0"], "argument --repeats: '0' is below 1"),
    (["quantize", "--m", "0"], "argument --m: '0' is below 1"),
    (["quantize", "--k", "100"], "argument --k: '100' is not a multiple of 16"),
    (["quantize", "--k", "0"], "argument --k: '0' is below 16"),
    (["contracts", "--calls", "0"], "argument --calls: '0' is below 1"),
])
def test_bench_counts_out_of_range_are_usage_errors(capsys, argv, says):
    # tried as a new user would: --repeats 0 gave rows of "StatisticsError: no median for empty data" and exit 0,
    # bench contracts --calls 0 a ZeroDivisionError traceback, --calls -5 negative times, bench quantize --m 0 and
    # --k 100 tracebacks (amax of an empty tensor, a ShapeError), --timeout 0 a TimeoutError traceback
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("grouped", ["0,4", "4,0", "-1,4"])
def test_bench_quantize_grouped_sizes_below_one_exit_2(tmp_path, capsys, grouped):
    # "0,4" silently ran an ungrouped [4, K] row, "-1,4" ended in a traceback
    assert main(["quantize", "--m", "1", "--k", "32", f"--grouped={grouped}", "--out", str(tmp_path),
                 "--no-plot"]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench quantize: --grouped") and grouped in line and ">= 1" in line


def test_bench_moe_ranks_past_the_timeout_end_in_one_line(tmp_path, capsys):
    # tried as a new user would: ranks that did not finish within --timeout ended in a TimeoutError traceback
    assert main(["moe", "--ep", "2", "--timeout", "0.01", "--tokens", "1", "--mode", "normal", "--repeats", "1",
                 "--out", str(tmp_path), "--no-plot"]) == 1
    line = _last_line(capsys.readouterr().out)
    # the timeout as given, not rounded to "0 s"
    assert line.startswith("bench moe: ") and "did not finish within 0.01 s" in line and "--timeout" in line


def test_bench_moe_empty_runner_list_is_a_usage_error(capsys):
    # `--runner ,,` ran nothing and exited 1 saying "reasons above" with no reason above
    with pytest.raises(SystemExit) as exc:
        main(["moe", "--runner", ",,"])
    assert exc.value.code == 2 and "argument --runner: empty list" in capsys.readouterr().err


def test_bench_moe_scaling_with_a_missing_or_foreign_csv_exits_2(tmp_path, capsys):
    # a missing CSV ended in a FileNotFoundError traceback, a CSV of something else in a KeyError/ParserError one
    missing = tmp_path / "nope.csv"
    assert main(["moe", "--scaling", str(missing), "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench moe --scaling: ") and str(missing) in line
    other = tmp_path / "other.csv"
    pd.DataFrame({"a": [1], "b": [2]}).to_csv(other, index=False)
    assert main(["moe", "--scaling", str(other), "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert str(other) in line and "dispatch_ms" in line and "bench moe" in line
    assert not list(tmp_path.glob("*.png"))


def test_bench_moe_scaling_with_a_file_that_is_not_csv_says_so_in_one_line(tmp_path, capsys):
    # given the run's JSON instead of its CSV, pandas' two-line parser error split the message, its fix on a line of
    # its own
    js = tmp_path / "moe_ep2.json"
    js.write_text('{\n "plan": 1,\n "rows": [1, 2, 3]\n}\n')
    assert main(["moe", "--scaling", str(js), "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1, out
    assert out.startswith(f"bench moe --scaling: cannot read {js}") and "moe_ep<N>.csv" in out


@pytest.mark.parametrize("config, says", [("defualt", "neither JSON nor 'default'/'tuned'"),
                                          ("[1]", "must be a JSON object")])
def test_bench_attention_bad_config_is_a_usage_error(capsys, config, says):
    # exited 1 (a SystemExit with a message), not the usage error's 2
    with pytest.raises(SystemExit) as exc:
        main(["attention", "--config", config])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --config" in err and says in err


@pytest.mark.parametrize("backends", ["torch", "torch,flashmla"])
def test_bench_attention_config_for_backends_without_knobs_is_a_usage_error(tmp_path, capsys, backends):
    # the JSON config was dropped without a word: the rows ran each backend's only config, labelled "default"
    assert main(["attention", "--backend", backends, "--config", '{"BLOCK_N": 32}', "--batch", "1", "--seqlen", "16",
                 "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench attention: --config '{\"BLOCK_N\": 32}'") and f"--backend {backends}" in line
    assert "triton" in line and not list(tmp_path.iterdir())


def test_bench_attention_where_no_row_ran_exits_1_and_writes_no_empty_csv(tmp_path, capsys):
    # tried as a new user would on a CPU machine: `bench attention --backend triton` printed "[unavailable] ...",
    # wrote a 1-byte CSV that pandas cannot read (EmptyDataError) and exited 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine where the triton backend is unavailable")
    assert main(["attention", "--backend", "triton", "--batch", "1", "--seqlen", "16", "--heads", "16",
                 "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "[unavailable] mla_decode[triton]" in out
    line = _last_line(out)
    assert line.startswith("bench attention: no row ran") and "torch" in line
    for csv in tmp_path.glob("*.csv"):
        pd.read_csv(csv)  # whatever is written is readable


def test_bench_quantize_where_no_backend_ran_exits_1(tmp_path, capsys):
    # `bench quantize --backends triton` on a CPU machine: every row skipped, "backends that ran: none", exit 0
    from pdlab.kernels import registry

    if not registry.unavailable_reason("nvfp4_quantize", "triton"):
        pytest.skip("needs a machine where the triton backend is unavailable")
    assert main(["quantize", "--backends", "triton", "--m", "1", "--k", "32", "--grouped", "none",
                 "--out", str(tmp_path), "--no-plot"]) == 1
    out = capsys.readouterr().out
    assert "backends that ran: none" in out
    assert pd.read_csv(tmp_path / "quantize.csv")["status"].eq("skipped").all()


def test_kernel_resources_help_states_its_whole_first_sentence(capsys):
    # the description stopped mid-sentence: "... compiled for an NVIDIA arch on"
    from pdlab.bench import kernel_resources

    with pytest.raises(SystemExit) as exc:
        kernel_resources.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "compiled for an NVIDIA arch on any machine" in text


@pytest.mark.parametrize("argv, says", [
    (["--config", '{"BOGUS": 1}'], "unknown config keys ['BOGUS']"),
    (["--op", "moe_experts", "--config", '{"BOGUS": 1}'], "unknown config keys ['BOGUS']"),
])
def test_kernel_resources_unknown_config_key_exits_2(capsys, argv, says):
    # a --config with a knob the backend does not declare ended in a ValueError traceback
    from pdlab.bench import kernel_resources

    assert kernel_resources.main(argv) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("kernel_resources: --config") and says in line


@pytest.mark.parametrize("flag", ["--tokens", "--experts", "--heads", "--batch", "--seqlen", "--sm-count"])
def test_kernel_resources_sizes_below_one_are_usage_errors(capsys, flag):
    # --op moe_experts --tokens 0 ended in a KeyError traceback
    from pdlab.bench import kernel_resources

    with pytest.raises(SystemExit) as exc:
        kernel_resources.main([flag, "0"])
    assert exc.value.code == 2 and f"argument {flag}: '0' is below 1" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (["--tokenizer", "{missing}"], "--tokenizer {missing}"),
    (["--request-rate", "-1"], "--request-rate must be >= 0 requests/s (inf: all at once), got -1"),
])
def test_bench_serving_bad_tokenizer_or_rate_is_one_line_naming_the_option(tmp_path, capsys, extra, says):
    # a missing --tokenizer said only "No such file or directory (os error 2)", without the option or the path;
    # a negative --request-rate was taken as "all at once"
    missing = str(tmp_path / "no_tokenizer")
    extra = [e.format(missing=missing) for e in extra]
    assert main(["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
                 "--out", str(tmp_path / "out"), *extra]) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("bench serving: ") and says.format(missing=missing) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, says", [
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--vocab-size", "-5"], "--vocab-size must be >= 1, got -5"),
    (["--timeout", "0"], "--timeout must be > 0 seconds per request, got 0"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds per request, got nan"),
    (["--random-range-ratio", "2"], "--random-range-ratio must be in [0, 1], got 2"),
])
@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_bench_serving_bad_values_are_usage_errors_before_any_request(tmp_path, capsys, extra, says, model):
    # --vocab-size 0 was read as "not given" and -5 said only numpy's "high <= 0"; --timeout 0 let every request
    # time out; --random-range-ratio was checked only after the server had answered (a server that was down
    # gave "cannot reach", exit 1)
    assert main(["serving", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--out", str(tmp_path / "out"),
                 *model, *extra]) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("bench serving: ") and says in line
    assert not (tmp_path / "out").exists()


def test_bench_moe_takes_a_model_name_in_any_case_as_tune_does(tmp_path, capsys):
    # `tune moe --model DeepSeek-R1` plans R1's shapes; `bench moe --model DeepSeek-R1` said "unknown model"
    assert main(["moe", "--model", "DeepSeek-R1", "--tokens", "1", "--mode", "normal", "--repeats", "1",
                 "--warmup", "0", "--out", str(tmp_path), "--no-plot"]) == 0
    meta = json.loads((tmp_path / "moe_ep1.json").read_text())["meta"]
    assert meta["plan"]["cfg"]["num_experts"] in (16, 256)  # the CPU's small shape, or R1's on a GPU


@pytest.mark.parametrize("argv", [
    ["moe", "--tokens", "1", "--repeats", "1", "--no-plot"],
    ["attention", "--seqlen", "16"],
    ["quantize", "--m", "1", "--k", "32", "--grouped", "none", "--no-plot"],
    ["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1"],
])
def test_an_out_that_is_a_file_exits_2_before_measuring(tmp_path, capsys, argv):
    # tried as a new user would: --out naming a file ended in a FileExistsError traceback, for bench moe,
    # quantize and serving only after the whole run (its measurements lost)
    target = tmp_path / "results.csv"
    target.write_text("x\n")
    assert main([*argv, "--out", str(target)]) == 2
    out, err = capsys.readouterr()
    line = _last_line(out + err)
    assert line.startswith(f"bench {argv[0]}: --out {target}") and "not a folder" in line
    assert target.read_text() == "x\n"


@pytest.mark.parametrize("argv, flag", [(["moe", "--tokens", "1", "--repeats", "1"], "--name"),
                                        (["attention", "--seqlen", "16"], "--name"),
                                        (["serving", "--base-url", "http://127.0.0.1:9", "--model", "m"], "--tag")])
def test_a_name_with_a_folder_in_it_is_a_usage_error(tmp_path, capsys, argv, flag):
    # bench attention --name sub/x ended in "OSError: Cannot save file into a non-existent directory", bench serving
    # --tag sub/x the same way after every request had run
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path), flag, "sub/x"])
    assert exc.value.code == 2 and f"argument {flag}: 'sub/x' is a file stem" in capsys.readouterr().err


def test_bench_serving_records_the_command_as_it_was_typed(tmp_path, capsys, monkeypatch):
    # run as `pdlab bench serving ...` the JSON recorded "bench serving serving ..."
    argv = ["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
            "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["/usr/bin/pdlab", "bench", *argv])
    assert main(argv) == 1  # nothing listens: every request failed
    meta = json.loads((tmp_path / "serving.json").read_text())["meta"]
    assert meta["command"] == "pdlab bench " + " ".join(argv)


def test_bench_moe_prints_a_skipped_rows_whole_reason(tmp_path, capsys):
    # the reason was cut at 160 characters, before the payloads the runner accepts and the runners that would do
    assert main(["moe", "--runner", "torch_grouped", "--dispatch", "fp8", "--mode", "normal", "--tokens", "1",
                 "--repeats", "1", "--out", str(tmp_path), "--no-plot"]) == 1
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.strip().startswith("skipped normal t1 fp8 torch_grouped")]
    assert len(skipped) == 1 and "payloads ('bf16',)" in skipped[0] and "Fix:" in skipped[0]


def test_bench_attention_leaves_only_its_results_behind(tmp_path, capsys):
    # the partial CSV (written after each shape, so that a crash keeps the rows measured) stayed beside the final one
    assert main(["attention", "--backend", "torch", "--batch", "1", "--seqlen", "64", "--heads", "16",
                 "--out", str(tmp_path), "--name", "run"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "run.csv" in names and not [n for n in names if "partial" in n], names
    assert len(pd.read_csv(tmp_path / "run.csv")) >= 1


@pytest.mark.parametrize("argv,says", [
    (["attention", "--op", "prefill", "--s-q", "2"], "--s-q applies to --op decode"),
    (["attention", "--new-tokens", "4"], "--new-tokens applies to --op prefill"),
    (["moe", "--mode", "normal", "--ll-tokens", "16"], "--ll-tokens sets the low-latency rows"),
    (["moe", "--mode", "normal", "--num-max-dispatch-tokens", "64"],
     "--num-max-dispatch-tokens sizes the low-latency buffer; this run is --mode normal"),
])
def test_an_option_the_run_would_ignore_is_a_usage_error(argv, says, tmp_path, capsys):
    # these options were silently ignored: the run measured other shapes than the command line named
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert says in _last_line(capsys.readouterr().out)


def test_bench_moe_normal_mode_takes_the_buffer_flag_at_its_default(tmp_path, capsys):
    # a script that spells out the buffer's default (what a normal-mode run builds with) still runs
    assert main(["moe", "--mode", "normal", "--num-max-dispatch-tokens", "128", "--tokens", "1", "--runner", "torch",
                 "--repeats", "1", "--warmup", "0", "--no-reference", "--no-plot", "--out", str(tmp_path)]) == 0
    assert pd.read_csv(tmp_path / "moe_ep1.csv")["status"].tolist() == ["ok"]


def test_bench_quantize_title_names_no_share_of_a_bandwidth_it_lacks(tmp_path, capsys, monkeypatch):
    # the table's title read "pct_bw = % of no bandwidth figure" on a machine with no bandwidth figure
    import dataclasses

    from pdlab.kernels import arch

    facts = arch.device_facts()
    monkeypatch.setattr(arch, "device_facts", lambda *a, **k: dataclasses.replace(facts, peaks=None))
    assert main(["quantize", "--m", "1", "--backends", "torch", "--grouped", "none", "--repeats", "1", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "% of no bandwidth" not in out and "no bandwidth figure: no pct_bw" in out


def test_bench_quantize_sweep_runs_at_the_cpu_shape_without_a_gpu(tmp_path, capsys, monkeypatch):
    # on CPU the sweep ran at R1's [4096, 7168]: under TRITON_INTERPRET=1 minutes per call, hours in all
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["quantize", "--sweep", "--m", "1", "4", "--k", "64", "--grouped", "none", "--repeats", "1",
                 "--out", str(tmp_path), "--no-plot"]) == 0
    df = pd.read_csv(tmp_path / "quantize.csv")
    sweep = df[df["config"] != "default"]
    assert len(sweep) > 10 and set(sweep["shape"]) == {"[4, 64]"} and set(sweep["backend"]) == {"triton"}


def test_bench_quantize_sweep_without_triton_in_the_backends_exits_2(tmp_path, capsys):
    assert main(["quantize", "--sweep", "--backends", "torch", "--grouped", "none", "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert "--sweep times the triton backend" in line and "--backends torch" in line
    assert not (tmp_path / "quantize.csv").exists()


def test_bench_quantize_measure_peaks_without_a_gpu_exits_2(tmp_path, capsys, monkeypatch):
    # it printed a note without the command's name and measured anyway, the flag ignored, under a title reading
    # "pct_bw = % of no bandwidth figure"
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["quantize", "--measure-peaks", "--grouped", "none", "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("bench quantize: --measure-peaks") and "CUDA GPU" in line and "drop --measure-peaks" in line
    assert not (tmp_path / "quantize.csv").exists()


def test_bench_attention_cuda_graph_without_a_gpu_exits_2(tmp_path, capsys, monkeypatch):
    # every row was timed eagerly, with nothing said, where --cuda-graph asked for graph replays
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["attention", "--cuda-graph", "--out", str(tmp_path)]) == 2
    line = _last_line(capsys.readouterr().out)
    assert "--cuda-graph" in line and "needs a CUDA GPU" in line
    assert not (tmp_path / "mla_decode.csv").exists()


@pytest.mark.parametrize("argv, seqlen, s_q, shape", [
    (["--seqlen", "2", "--s-q", "4"], 4, 4, "B1 L4 H16 bf16 p16 q4"),  # each sequence holds its 4 new tokens
    (["--op", "prefill", "--seqlen", "3", "--new-tokens", "5"], 3, 3, "B1 L3 H16 bf16 p16 n3"),  # 3 are new
    (["--op", "prefill", "--seqlen", "40", "--new-tokens", "0"], 40, 40, "B1 L40 H16 bf16 p16 n40"),  # all new
])
def test_bench_attention_rows_name_the_lengths_they_ran(tmp_path, capsys, argv, seqlen, s_q, shape):
    # the rows said seqlen 2 (decode, 4 tokens ran) and s_q 5 (prefill, 3 new tokens ran)
    assert main(["attention", "--batch", "1", "--backend", "torch", "--repeats", "1", "--out", str(tmp_path)]
                + argv) == 0
    csv = tmp_path / ("mla_prefill.csv" if "prefill" in argv else "mla_decode.csv")
    row = pd.read_csv(csv).iloc[0]
    assert (row["seqlen"], row["s_q"], row["shape"]) == (seqlen, s_q, shape)
    capped = "--new-tokens 5 exceeds every --seqlen (at most 3): those rows prefill their whole sequence"
    assert (capped in capsys.readouterr().out) == ("5" in argv)  # a request the rows do not honour is said


def test_bench_serving_prints_the_paths_it_wrote(tmp_path, capsys):
    # it printed "wrote <out>/serving.json/.csv, serving_summary.csv, serving_latency.png": one made-up path
    assert main(["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
                 "--out", str(tmp_path), "--tag", "t"]) == 1  # nothing listens: every request failed
    wrote = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("wrote ")]
    assert sorted(wrote) == sorted(str(tmp_path / name) for name in ("t.json", "t.csv", "t_summary.csv",
                                                                      "t_latency.png"))


@pytest.mark.parametrize("url, says", [
    ("notaurl", "'notaurl' is not a server URL"),
    ("127.0.0.1:30000", "is not a server URL"),
    ("ftp://host:21", "is not a server URL"),
    ("http://", "is not a server URL"),
    ("http://host:port", "is not a server URL"),
    ("http://127.0.0.1:30000/v1", "drop the /v1"),
])
def test_bench_serving_malformed_base_url_is_a_usage_error(tmp_path, capsys, url, says):
    # --base-url notaurl ended in "cannot reach notaurl/v1/models ... is the server up?" (exit 1), or with --model
    # in every request failing with InvalidUrlClientError
    with pytest.raises(SystemExit) as exc:
        main(["serving", "--base-url", url, "--model", "m", "--num-prompts", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --base-url" in err and says in err and "http://host:port" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:30000", "https://example.com/", "http://[::1]:8000"])
def test_bench_serving_takes_a_server_root_url(url):
    from pdlab.bench.serving import server_url

    assert server_url(url) == url


@pytest.mark.parametrize("command", ["attention", "moe", "quantize", "serving"])
def test_every_bench_command_that_plots_takes_no_plot_with_one_meaning(capsys, command):
    # bench attention and bench serving had no --no-plot while bench moe and bench quantize did (without a help text)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-plot write no PNG plots (the CSV and JSON results are written as always)" in text


def test_bench_attention_no_plot_writes_the_csv_and_no_png(tmp_path, capsys):
    argv = ["attention", "--backend", "torch", "--batch", "1", "--seqlen", "16", "--heads", "16", "--repeats", "1"]
    assert main([*argv, "--out", str(tmp_path / "plots")]) == 0
    assert list((tmp_path / "plots").glob("*.png"))  # plots by default
    assert main([*argv, "--out", str(tmp_path / "none"), "--no-plot"]) == 0
    names = sorted(p.name for p in (tmp_path / "none").iterdir())
    assert names == ["mla_decode.csv", "mla_decode.json"]


def test_bench_serving_no_plot_writes_the_results_and_no_png(tmp_path, capsys):
    assert main(["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
                 "--out", str(tmp_path), "--no-plot"]) == 1  # nothing listens: every request failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serving.csv", "serving.json", "serving_summary.csv"]
    assert "png" not in capsys.readouterr().out


def test_bench_moe_scaling_no_plot_writes_the_csv_only(tmp_path, capsys):
    rows = pd.DataFrame({"ep": [2, 4], "mode": "normal", "tokens": 16, "payload": "bf16", "status": "ok",
                         "dispatch_ms": [1.0, 2.0], "combine_ms": [1.0, 2.0], "dispatch_GBps": [5.0, 6.0],
                         "combine_GBps": [5.0, 6.0]})
    rows.to_csv(tmp_path / "in.csv", index=False)
    assert main(["moe", "--scaling", str(tmp_path / "in.csv"), "--out", str(tmp_path / "out"), "--no-plot"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["moe_ep_scaling.csv"]
    assert "png" not in capsys.readouterr().out


@pytest.mark.parametrize("goodput, says", [
    (["ttft:abc"], "--goodput item 'ttft:abc': 'abc' is not a number of ms"),
    (["ttft:nan"], "--goodput ttft must be > 0 ms, got nan"),
    (["ttft:5000", "ttft:50"], "--goodput names ttft twice (5000 and 50)"),
])
def test_bench_serving_bad_goodput_is_a_usage_error_naming_the_option(tmp_path, capsys, goodput, says):
    # ttft:abc said only "could not convert string to float: 'abc'"; ttft:nan was taken (no request could meet it),
    # and a key given twice kept the last value without a word
    assert main(["serving", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
                 "--out", str(tmp_path / "out"), "--goodput", *goodput]) == 2
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("bench serving: ") and says in line
    assert not (tmp_path / "out").exists()


def test_bench_moe_scaling_writes_into_the_results_folder_its_help_names(tmp_path, capsys, monkeypatch):
    # --help says --out defaults to bench/results/<device>/moe or moe_ep; --scaling wrote into the current folder
    from pdlab.kernels.arch import device_facts

    rows = pd.DataFrame({"ep": [2, 4], "mode": "normal", "tokens": 16, "payload": "bf16", "status": "ok",
                         "dispatch_ms": [1.0, 2.0], "combine_ms": [1.0, 2.0], "dispatch_GBps": [5.0, 6.0],
                         "combine_GBps": [5.0, 6.0]})
    rows.to_csv(tmp_path / "in.csv", index=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PDLAB_RESULTS_DIR", str(tmp_path / "results"))
    assert main(["moe", "--scaling", "in.csv", "--no-plot"]) == 0
    assert (tmp_path / "results" / device_facts().key / "moe_ep" / "moe_ep_scaling.csv").exists()
    assert not (tmp_path / "moe_ep_scaling.csv").exists()


@pytest.mark.parametrize("argv, says", [
    (["--hidden", "100"], "argument --hidden: '100' is not a multiple of 16"),
    (["--inter", "0"], "argument --inter: '0' is below 16"),
    (["--experts", "0"], "argument --experts: '0' is below 1"),
    (["--shapes", "decod"], "argument --shapes: 'decod' is not one of decode, prefill"),
    (["--decode-tokens", "1,x"], "argument --decode-tokens: 'x' is not an integer"),
    (["--layouts", "dense"], "argument --layouts: 'dense' is not one of masked, contiguous"),
    (["--payloads", "fp4"], "argument --payloads: 'fp4' is not one of bf16, fp8, nvfp4"),
    (["--config", "{bad"], "argument --config: '{bad' is not a JSON object"),
])
def test_bench_moe_experts_bad_values_are_usage_errors(tmp_path, capsys, argv, says):
    # --hidden 100 and --experts 0 ended in torch tracebacks; --shapes decod was ignored and the default (R1-sized)
    # shapes ran for minutes on a CPU
    from pdlab.bench import moe_experts

    with pytest.raises(SystemExit) as exc:
        moe_experts.main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bench_moe_experts_unknown_runner_or_bad_out_exits_2_in_one_line(tmp_path, capsys):
    # --runners nope ended in a KeyError traceback
    from pdlab.bench import moe_experts

    small = ["--experts", "2", "--hidden", "32", "--inter", "32", "--shapes", "decode", "--decode-tokens", "1"]
    assert moe_experts.main([*small, "--runners", "torch,nope", "--out", str(tmp_path / "out")]) == 2
    line = _last_line(capsys.readouterr().out)
    assert line.startswith("pdlab.bench.moe_experts: moe_experts has no backend named 'nope'") and "torch" in line
    target = tmp_path / "file"
    target.write_text("x")
    assert moe_experts.main([*small, "--runners", "torch", "--out", str(target)]) == 2
    assert _last_line(capsys.readouterr().out).startswith(f"pdlab.bench.moe_experts: --out {target}")


def test_bench_moe_experts_prints_the_files_it_wrote(tmp_path, capsys):
    from pdlab.bench import moe_experts

    assert moe_experts.main(["--experts", "2", "--hidden", "32", "--inter", "32", "--shapes", "decode",
                             "--decode-tokens", "1", "--runners", "torch", "--layouts", "contiguous",
                             "--payloads", "bf16", "--out", str(tmp_path)]) == 0
    wrote = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert wrote and all((tmp_path / p).is_file() or __import__("os").path.isfile(p) for p in wrote)
    assert str(tmp_path / "moe_experts.csv") in wrote
