"""`tune`: the --arch gate (exit 2, one line), --dry-run without a GPU, a CPU run through the CLI, `tune show`."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from pdlab.kernels.arch import detect_arch
from pdlab.tuning import command
from pdlab.tuning.cli import main

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the gate tests expect a machine without GPU")


@needs_cpu_only
@pytest.mark.parametrize("sub", ["attention", "moe", "dispatch"])
def test_arch_gate_exits_2_with_one_line(sub, capsys):
    assert main([sub, "--arch", "sm100"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "--arch sm100" in lines[0] and "this machine is cpu" in lines[0] and "--dry-run" in lines[0]
    assert lines[0].startswith(f"tune {sub}:")


@needs_cpu_only
def test_arch_gate_without_arch_on_cpu(capsys):
    assert main(["attention"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU detected" in err[0] and "--dry-run" in err[0]


def test_arch_gate_rule():
    assert command.arch_gate("t", "sm90", "sm90", False) is None
    assert command.arch_gate("t", "sm90a", "sm90", False) is None  # suffixes are one family
    assert command.arch_gate("t", "sm103", "sm100", False) is None
    assert "sm100" in command.arch_gate("t", "sm100", "sm90", False)
    assert command.arch_gate("t", "sm100", "sm90", True) is None  # dry run never gated
    assert command.arch_gate("t", None, "sm90", False) is None  # default: the detected arch
    assert command.arch_gate("t", "cpu", "sm90", False) is None  # the CPU is always there


@needs_cpu_only
def test_gate_is_immediate_in_a_fresh_process():
    code = "import sys; from pdlab.tuning.cli import main; sys.exit(main(['attention', '--arch', 'sm100']))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "optuna" not in res.stderr


def _args(*argv):
    p = argparse.ArgumentParser()
    command.add_common_arguments(p, ["toy_matmul"], "toy_matmul")
    return p.parse_args(list(argv))


def test_dry_run_prints_backends_spaces_buckets(toy, capsys):
    assert command.run_tune("tune toy", _args("--arch", "sm100", "--dry-run"), ["toy_matmul"]) == 0
    out = capsys.readouterr().out
    assert "target arch sm100" in out and f"this machine: {detect_arch()}" in out
    assert "sm100only" in out and "definitely_not_installed_pkg (not here)" in out
    assert "tile: [64, 128]" in out and "BLOCK_K: [0, 4, 16, 64]" in out
    assert "wide" not in out  # cpu-only backend is not searched on sm100
    assert "2 buckets" in out and "m: 16, 64" in out
    assert "grid" in out


def test_dry_run_real_ops_without_gpu(capsys):
    assert main(["attention", "--arch", "sm100", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mla_decode" in out and "96 buckets" in out
    assert "batch: 1, 8, 32, 64, 128, 256" in out and "seqlen: 1024, 4096, 8192, 16384" in out
    assert "heads: 16, 128" in out and "kv_dtype: bf16, fp8" in out
    assert main(["moe", "--arch", "sm90", "--dry-run", "--only", "experts=64"]) == 0
    out = capsys.readouterr().out
    assert "tokens_per_expert: 1, 4, 16, 64, 256, 1024, 2048" in out and "experts: 64" in out
    # decode steps that reach only some experts are buckets of their own (one token on 8 or 32 of the 64)
    assert "active_experts: 8, 32, 64" in out and "32 buckets" in out
    from pdlab.moe.triton.nvfp4_frag import HAVE_GLUON

    if HAVE_GLUON:  # on sm90 the experts' triton runner is searched over its fragment GEMMs' knobs only
        assert "1728–41472 configs by bucket" in out and "the knobs that matter on this arch" in out
        assert ("triton (23 buckets): FRAG_BM: [16, 32, 64]; FRAG_UNROLL: [1, 2]; FRAG_XASYNC: [0, 1]; "
                "FRAG_RING: [0, 2, 3]; FRAG_RING_DOWN: [0, 2, 3]; FRAG_PAIR_DOWN: [0, 1]; FRAG_XRING: [0, 1]; "
                "FRAG_PDL: [0, 1]; FRAG_MMA_ASYNC: [0, 1] (") in out
    assert main(["moe", "--arch", "sm100", "--dry-run", "--only", "experts=64"]) == 0
    out = capsys.readouterr().out
    assert "195689447424 configs" in out and "the knobs that matter" not in out  # elsewhere: the whole space
    assert main(["dispatch", "--arch", "sm90", "--dry-run"]) == 0
    assert "tokens_per_rank" in capsys.readouterr().out


def test_arch_cpu_tunes_a_named_model_at_small_shapes(tmp_path, capsys):
    """R1's experts take minutes to quantise on a CPU before the first trial: `--arch cpu` tunes a named model at
    bench moe's CPU shapes (and says so), a config file at its own shapes."""
    assert main(["moe", "--arch", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "small shapes (deepseek-r1-cpu-small: 16 experts, top-4, hidden 256, intermediate 128" in out
    assert "experts: 4, 16" in out and "hidden: 256" in out and "intermediate: 128" in out
    cfg = {"hidden_size": 512, "num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["moe", "--arch", "cpu", "--dry-run", "--model", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "small shapes" not in out and "hidden: 512" in out and "intermediate: 64" in out
    assert main(["moe", "--arch", "sm90", "--dry-run"]) == 0  # a GPU target keeps R1's
    out = capsys.readouterr().out
    assert "small shapes" not in out and "hidden: 7168" in out


def test_cli_run_on_cpu_then_show(toy, isolated, capsys):
    args = _args("--arch", "cpu", "--backends", "blocked", "--only", "m=16", "--repeats", "3", "--budget", "60s",
                 "--storage", str(isolated / "t.db"), "--out", str(isolated / "out"), "--no-progress")
    assert command.run_tune("tune toy", args, ["toy_matmul"]) == 0
    out = capsys.readouterr().out
    assert "geometric-mean speedup" in out
    path = isolated / "configs" / "cpu" / "toy_matmul.json"
    data = json.loads(path.read_text())
    assert list(data["entries"]) == ["dtype=fp32,k=64,m=16"]
    # the model shape the buckets came from: --arch cpu tunes the named default at its small CPU shapes
    assert data["metadata"]["model_shape"]["name"] == "deepseek-r1-cpu-small" and data["metadata"]["versions"]["torch"]
    assert (isolated / "out" / "tuning.csv").exists() and (isolated / "out" / "plots" / "toy_matmul" / "speedup.png").exists()
    # --no-plot: the same summary, no PNG (its own storage and store: the files above stay as they are)
    args = _args("--arch", "cpu", "--backends", "blocked", "--only", "m=16", "--repeats", "3", "--budget", "60s",
                 "--storage", str(isolated / "t2.db"), "--store", str(isolated / "store2"), "--out",
                 str(isolated / "out2"), "--no-progress", "--no-plot")
    assert command.run_tune("tune toy", args, ["toy_matmul"]) == 0
    assert f"summary in {isolated / 'out2'}" in capsys.readouterr().out
    assert (isolated / "out2" / "tuning.csv").exists() and not list((isolated / "out2").rglob("*.png"))
    assert main(["show", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "toy_matmul.json" in out and "used" in out and "blocked*" in out
    assert main(["show", "--device", "cpu", "--geomean"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "toy_matmul.json" in x][0]
    speedup = data["entries"]["dtype=fp32,k=64,m=16"]["speedup"]
    assert f"1 buckets, geometric-mean speedup over default {speedup:.3f}x" in line and "[used]" in line


def test_geomean_line_counts_the_backend_choice_over_each_backends_default():
    """Two buckets searched with backends a and b: the winners' own speedups (2.0 and 1.0) and, with the backend
    choice, each backend's default time over the bucket's time: a 4/2 and 3/3, b 6/2 and 3/3 (hand-computed)."""
    from pdlab.tuning.show import geomean_line

    entries = {
        "x=1": {"bucket": {"x": 1}, "backend": "a", "time_ms": 2.0, "speedup": 2.0,
                "backends": {"a": {"time_ms": 2.0, "default_time_ms": 4.0}, "b": {"time_ms": 6.0, "default_time_ms": 6.0}}},
        "x=2": {"bucket": {"x": 2}, "backend": "b", "time_ms": 3.0, "speedup": 1.0,
                "backends": {"a": {"time_ms": 3.5, "default_time_ms": 3.0}, "b": {"time_ms": 3.0, "default_time_ms": 3.0}}},
    }
    line = geomean_line("f.json", {"entries": entries}, "used")
    assert "2 buckets, geometric-mean speedup over default 1.414x" in line
    assert "with the backend choice, over each backend's default: a 1.414x (2), b 1.732x (2)" in line
    one = {k: {**e, "backends": {e["backend"]: e["backends"][e["backend"]]}} for k, e in entries.items()}
    assert "backend choice" not in geomean_line("f.json", {"entries": one}, "used")


def test_show_marks_backend_choices_from_times_measured_in_different_runs():
    """A bucket whose backends were timed 3 h apart (another run) is counted and marked; 10 min apart (one run),
    one timed backend, or a date missing is not."""
    from pdlab.tuning.show import geomean_line, measured_apart

    def entry(x, dates, times=(2.0, 3.0)):
        backends = {name: {"time_ms": t, "default_time_ms": 4.0, "date": d}
                    for name, t, d in zip("ab", times, dates)}
        return {"bucket": {"x": x}, "backend": "a", "time_ms": 2.0, "speedup": 2.0, "backends": backends}

    apart = entry(1, ("2026-12-02T08:12:05Z", "2026-12-02T11:30:00Z"))
    close = entry(2, ("2026-12-02T08:12:05Z", "2026-12-02T08:22:05Z"))
    untimed = entry(3, ("2026-12-01T08:00:00Z", "2026-12-02T08:00:00Z"), times=(2.0, None))
    undated = entry(4, ("2026-12-02T08:12:05Z", None))
    assert [measured_apart(e) for e in (apart, close, untimed, undated)] == [True, False, False, False]
    entries = {str(i): e for i, e in enumerate((apart, close, untimed, undated))}
    assert "1 of 4 backend choices from times measured over 1 h apart" in geomean_line("f", {"entries": entries}, "")
    entries.pop("0")
    assert "measured over" not in geomean_line("f", {"entries": entries}, "")


def test_show_by_device_key_or_name_reads_the_shipped_files_without_that_device(capsys):
    # the shipped H200 files, asked for on a CPU machine by key and by name; geomean split by kv_dtype
    import math

    from pdlab.kernels import tuned

    data = json.loads((tuned.SHIPPED_DIR / "NVIDIA_H200" / "mla_decode.json").read_text())
    fp8 = [e["speedup"] for e in data["entries"].values() if e["bucket"]["kv_dtype"] == "fp8"]
    for dev in ("NVIDIA_H200", "NVIDIA H200", "nvidia_h200"):  # any letter case names the stored key
        assert main(["show", "--device", dev, "--geomean", "--op", "mla_decode"]) == 0
        out = capsys.readouterr().out
        assert "device NVIDIA H200 (sm90), key NVIDIA_H200" in out
        line = [x for x in out.splitlines() if "mla_decode.json" in x][0]
        assert f"fp8 {math.exp(sum(map(math.log, fp8)) / len(fp8)):.3f}x ({len(fp8)})" in line and "[used" in line
    assert main(["show", "--device", "no_such_gpu"]) == 0
    assert "no tuned-config files for no_such_gpu" in capsys.readouterr().out


def test_only_that_matches_no_bucket_is_an_error_listing_the_values(capsys):
    # `--only batch=abc` used to print a plan of 0 buckets and exit 0
    from pdlab.tuning.target import filter_buckets

    buckets = [{"batch": b, "kv_dtype": k} for b in (1, 8, 128) for k in ("bf16", "fp8")]
    assert filter_buckets(buckets, {"batch": ["8", "128"], "kv_dtype": ["fp8"]}) == [
        {"batch": 8, "kv_dtype": "fp8"}, {"batch": 128, "kv_dtype": "fp8"}]
    with pytest.raises(ValueError, match=r"--only batch=3 matches none of the 6 buckets; the buckets have batch: 1, 8, 128"):
        filter_buckets(buckets, {"batch": ["3"]})
    with pytest.raises(ValueError, match="buckets have no key 'heads'"):
        filter_buckets(buckets, {"heads": ["16"]})
    assert main(["attention", "--only", "batch=abc", "--dry-run", "--arch", "sm90"]) == 2
    assert "--only batch=abc matches none of the" in capsys.readouterr().err


def test_backends_that_nobody_registered_are_an_error_naming_the_registered_ones(capsys):
    # `tune attention --backends flashmal` used to plan 0 studies and exit 0; a name registered for one of the ops
    # tuned is accepted (trtllm_mla is a decode backend only)
    assert main(["attention", "--backends", "triton,flashmal", "--dry-run", "--arch", "sm90"]) == 2
    err = capsys.readouterr().err
    assert "--backends flashmal: no such backend of mla_decode; registered: flashinfer, flashmla, torch, triton" in err
    assert main(["attention", "--op", "all", "--backends", "trtllm_mla", "--dry-run", "--arch", "sm100"]) == 0
    assert main(["moe", "--backends", "tritn", "--dry-run", "--arch", "sm90"]) == 2
    assert "no such backend of moe_experts; registered: cutedsl, torch, torch_grouped, triton" in capsys.readouterr().err
    # a registered backend that does not run on the target: the plan says so (it said no backend was registered)
    assert main(["attention", "--op", "mla_decode", "--backends", "flashmla", "--dry-run", "--arch", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "none of --backends flashmla runs mla_decode on sm100 (there: " in out and "0 studies" in out


@pytest.mark.parametrize("part", ["build", "call"])
def test_a_run_that_stores_nothing_exits_1_saying_why(toy, isolated, capsys, monkeypatch, part):
    # every bucket's inputs failed (a model routing more experts than it has), or every trial failed: the run printed
    # "nothing stored" and exited 0, as a run that stored its winners does
    from pdlab.tuning.target import get_target

    def broken(*args, **kwargs):
        raise RuntimeError("selected index k out of range")

    monkeypatch.setattr(get_target("toy_matmul"), part, broken)
    args = _args("--arch", "cpu", "--backends", "blocked", "--only", "m=16", "--repeats", "3", "--trials", "4",
                 "--storage", str(isolated / "t.db"), "--out", str(isolated / "out"), "--no-progress")
    assert command.run_tune("tune toy", args, ["toy_matmul"]) == 1
    err = capsys.readouterr().err
    assert "tune toy: toy_matmul: nothing stored" in err and "selected index k out of range" in err
    assert not (isolated / "configs" / "cpu" / "toy_matmul.json").exists()


@pytest.mark.parametrize("store, told", [("elsewhere", True), ("configs", False)])
def test_a_store_nothing_reads_is_followed_by_how_to_use_it(toy, isolated, capsys, store, told):
    # with --store, the hint to export PDLAB_CONFIG_DIR was never printed, though only $PDLAB_CONFIG_DIR (here
    # isolated/configs) and the shipped folder are read: configs stored elsewhere went unused without a word
    args = _args("--arch", "cpu", "--backends", "blocked", "--only", "m=16", "--repeats", "3", "--budget", "60s",
                 "--storage", str(isolated / "t.db"), "--store", str(isolated / store), "--out", str(isolated / "out"),
                 "--no-progress")
    assert command.run_tune("tune toy", args, ["toy_matmul"]) == 0
    assert (isolated / store / "cpu" / "toy_matmul.json").exists()
    out = capsys.readouterr().out
    assert (f"to use these configs: export PDLAB_CONFIG_DIR={isolated / store}" in out) == told
