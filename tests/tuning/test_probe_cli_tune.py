"""`tune` as a new user drives it with odd input: one line naming what was wrong and the valid choices
(exit 2), never a traceback."""

import pytest
import torch

from pdlab.tuning.cli import main

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a machine without GPU")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("sub", ["attention", "moe", "dispatch"])
@pytest.mark.parametrize("dry", [True, False])
def test_an_arch_that_is_no_arch_exits_2_naming_the_form(sub, dry, capsys):
    # tried as a new user would: `tune attention --dry-run --arch bogus` printed a plan for "bogus" and exited 0;
    # without --dry-run the gate said "tuning must run on a bogus device"
    assert main([sub, "--arch", "bogus"] + (["--dry-run"] if dry else [])) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert line.startswith(f"tune {sub}: --arch 'bogus'") and "sm90" in line and "sm100" in line and "cpu" in line
    assert out == ""


@pytest.mark.parametrize("arch", ["sm90", "SM90", "sm90a", "sm100", "sm103", "sm120", "cpu"])
def test_real_archs_still_plan(arch, capsys):
    assert main(["dispatch", "--arch", arch, "--dry-run"]) == 0
    capsys.readouterr()


@needs_cpu_only
@pytest.mark.parametrize("argv", [["attention", "--device", "cuda:0", "--dry-run"],
                                  ["moe", "--device", "cuda:0", "--arch", "cpu"],
                                  ["show", "--device", "cuda:1"]])
def test_a_cuda_device_on_a_machine_without_one_exits_2(argv, capsys):
    # `tune attention --device cuda:0 --dry-run` and `tune show --device cuda:1` ended in
    # "AssertionError: Torch not compiled with CUDA enabled" tracebacks
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--device cuda:" in line and "no CUDA device" in line


@pytest.mark.parametrize("device", ["garbage", "meta", "mps"])
@pytest.mark.parametrize("dry", [True, False])
def test_a_device_tune_cannot_run_on_exits_2_naming_the_choices(capsys, device, dry):
    # `--device garbage` ended in torch's RuntimeError traceback; `--device meta` planned, then every bucket's inputs
    # failed ("META device type not an accelerator")
    assert main(["moe", "--arch", "cpu", "--device", device, "--budget", "3s", "--no-progress"]
                + (["--dry-run"] if dry else [])) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"tune moe: --device {device!r}: ") and "cuda:N" in line and "cpu" in line


def test_show_of_an_op_nobody_registered_exits_2_naming_the_ops(capsys):
    # `tune show --op bogus` said "no tuned-config files for cpu and op bogus" and exited 0
    assert main(["show", "--op", "mla_decod"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("tune show: --op 'mla_decod'") and "mla_decode" in line and "moe_experts" in line


@pytest.mark.parametrize("content, says", [('{"hidden_size": 512,', "not JSON"), ("[1, 2]", "JSON object")])
def test_a_model_file_that_is_not_a_json_object_names_the_file(tmp_path, capsys, content, says):
    # a config.json cut short printed only json's "Expecting property name ..." without --model or the file
    cfg = tmp_path / "config.json"
    cfg.write_text(content)
    assert main(["attention", "--arch", "sm90", "--dry-run", "--model", str(cfg)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--model" in line and str(cfg) in line and says in line


def test_a_model_file_with_a_null_size_names_the_field(tmp_path, capsys):
    import json

    fields = dict(hidden_size=512, num_attention_heads=8, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
                  moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=None)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(fields))
    assert main(["moe", "--arch", "sm90", "--dry-run", "--model", str(cfg)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(cfg) in line and "num_experts_per_tok" in line


@pytest.mark.parametrize("sub", ["attention", "moe", "dispatch"])
def test_a_model_routing_more_experts_than_it_has_names_both_fields(tmp_path, capsys, sub):
    # top-8 of 4 experts was planned; tuning then failed every bucket's inputs ("selected index k out of range")
    # and exited 0 with nothing stored
    import json

    fields = dict(hidden_size=512, num_attention_heads=8, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
                  moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=8)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(fields))
    assert main([sub, "--arch", "sm90", "--dry-run", "--model", str(cfg)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(cfg) in line and "num_experts_per_tok=8" in line and "n_routed_experts=4" in line


def test_a_store_folder_that_cannot_be_written_exits_2_before_tuning(tmp_path, capsys, monkeypatch):
    # a PDLAB_CONFIG_DIR under a file: the search ran, then writing its first bucket ended in a NotADirectoryError
    # traceback, the measurements lost
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDLAB_CONFIG_DIR", str(blocker / "configs"))
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["moe", "--arch", "cpu", "--out", str(tmp_path / "out"), "--budget", "5s", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert str(blocker / "configs") in line and "PDLAB_CONFIG_DIR" in line and "is not a folder" in line
    assert "trial" not in out


def test_speedup_plot_labels_name_only_what_differs_between_buckets(tmp_path, monkeypatch):
    # tune moe --arch cpu drew every bucket's whole label (7 keys) under its bar: cut off at the figure's edge,
    # every visible part the same ("..._expert=1 / grouped]"), and a tight-layout warning
    from types import SimpleNamespace

    from pdlab.tuning import plots

    shared = dict(hidden=256, intermediate=128, payload="bf16", tokens_per_expert=1)
    winners = [(dict(shared, experts=e, active_experts=a, layout=lay),
                SimpleNamespace(backend="torch_grouped", default_time_ms=1.0, time_ms=0.9))
               for e, a in ((16, 16), (16, 8), (4, 4)) for lay in ("contiguous", "masked")]
    seen = {}

    def save(fig, plt, path):
        ax = fig.axes[0]
        seen["ticks"] = [t.get_text() for t in ax.get_xticklabels()]
        seen["text"] = ax.get_xlabel() + " " + ax.get_title()
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", save)
    plots.plot_speedup("moe_experts", "cpu", winners, tmp_path / "speedup.png")
    ticks = seen["ticks"]
    assert ticks[0].splitlines()[0] == "active_experts=16,experts=16,layout=contiguous"
    assert all("hidden=" not in t and "tokens_per_expert" not in t for t in ticks)
    assert len(set(ticks)) == len(ticks)
    assert "hidden=256" in seen["text"] and "tokens_per_expert=1" in seen["text"]


def test_history_plot_title_stays_inside_the_figure(tmp_path, monkeypatch):
    # a moe_experts bucket label on one line ran past both edges of the 7-inch figure (cut at both ends)
    from types import SimpleNamespace

    from pdlab.kernels import tuned
    from pdlab.tuning import plots

    bucket = {"active_experts": 8, "experts": 256, "hidden": 7168, "intermediate": 2048, "layout": "contiguous",
              "payload": "nvfp4", "tokens_per_expert": 1}
    study = SimpleNamespace(history=[(0, 1.0, "COMPLETE"), (1, None, "FAIL"), (2, 0.8, "COMPLETE")],
                            default_time_ms=0.9)
    seen = {}

    def save(fig, plt, path):
        fig.tight_layout()
        renderer = fig.canvas.get_renderer()
        box = fig.axes[0].title.get_window_extent(renderer)
        seen.update(x0=box.x0, x1=box.x1, width=fig.bbox.width, text=fig.axes[0].get_title())
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", save)
    label = tuned.bucket_label(bucket)
    plots.plot_history(study, tmp_path / "h.png", title=f"moe_experts [triton] {label}")
    assert seen["x0"] >= 0 and seen["x1"] <= seen["width"], seen
    assert all(f"{k}={v}" in seen["text"].replace("\n", "") for k, v in bucket.items())  # wrapped, nothing lost


@pytest.mark.parametrize("argv, says", [
    (["--trials", "0"], "argument --trials: '0' is below 1"),
    (["--repeats", "0"], "argument --repeats: '0' is below 1"),
    (["--warmup", "-1"], "argument --warmup: '-1' is below 0"),
    (["--seed", "-1"], "argument --seed: '-1' is below 0"),
])
def test_counts_out_of_range_are_usage_errors(capsys, argv, says):
    # tried as a new user would: --trials 0 / --repeats 0 / --warmup -1 ran every study to "no median for empty
    # data" or "no trial produced a correct result" and exited 0; --seed -1 failed the op after planning it
    with pytest.raises(SystemExit) as exc:
        main(["moe", "--arch", "cpu", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_storage_url_optuna_cannot_open_exits_2_before_tuning(tmp_path, capsys, monkeypatch):
    # --storage bogus://x ended in a sqlalchemy NoSuchModuleError traceback
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["moe", "--arch", "cpu", "--storage", "bogus://x", "--store", str(tmp_path / "st"),
                 "--out", str(tmp_path / "out"), "--budget", "5s", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert line.startswith("tune moe: --storage 'bogus://x'") and "sqlite" in line
    assert "trial" not in out


@pytest.mark.parametrize("dry", [True, False])
def test_dispatch_ep_that_does_not_divide_the_experts_exits_2_at_once(capsys, dry):
    # README: an --ep that does not divide the experts ends tune at once (exit 2); `tune dispatch --ep 3 --arch cpu`
    # started 3 ranks, failed every trial ("num_experts=16 is not divisible by the 3 ranks") and exited 0
    assert main(["dispatch", "--ep", "3", "--arch", "cpu"] + (["--dry-run"] if dry else [])) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("tune dispatch: --ep 3") and "16 experts" in line and "1, 2, 4, 8, 16" in line


def test_dispatch_ep_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dispatch", "--ep", "0", "--arch", "cpu", "--dry-run"])
    assert exc.value.code == 2 and "argument --ep: '0' is below 1" in capsys.readouterr().err


def test_where_only_the_reference_runs_tune_says_how_to_search_it(tmp_path, capsys, monkeypatch):
    # `tune attention --arch cpu` said "no backend ... can run: none registered", though the torch reference is
    # registered and runs here (it is searched only when named), then told the user to export a store it never wrote
    if torch.cuda.is_available():
        pytest.skip("needs a machine where only the reference of mla_decode runs")
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))  # the default store: ~/.cache/pdlab/configs
    monkeypatch.delenv("PDLAB_CONFIG_DIR", raising=False)
    assert main(["attention", "--arch", "cpu", "--budget", "5s", "--no-progress", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr()
    assert "the reference (torch) is searched only when named: --backends torch" in err.err
    assert "none registered" not in err.err + err.out and "to use these configs" not in err.out


def test_show_prints_each_bucket_label_whole(isolated, capsys):
    # the labels have no spaces: rich cut them at the column width, so buckets that differ only in their last
    # keys (seqlen, tokens_per_expert) printed alike
    from pdlab.kernels import tuned
    from pdlab.tuning import store

    bucket = {"active_experts": 8, "experts": 256, "hidden": 7168, "intermediate": 2048, "layout": "masked",
              "payload": "nvfp4", "tokens_per_expert": 1}
    results = {}
    for tpe in (1, 16):
        results.update(store.merge_bucket({**bucket, "tokens_per_expert": tpe},
                                          {"torch_grouped": store.backend_result({}, 1.0, 1.0)}))
    store.write_results(isolated / "configs", "cpu", "moe_experts", {"device": "cpu"}, results)
    assert main(["show", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    # the bucket column, cell by cell (a folded label continues on the next lines)
    column = "".join(line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│"))
    for tpe in (1, 16):
        assert tuned.bucket_label({**bucket, "tokens_per_expert": tpe}) in column


@pytest.mark.parametrize("make, note", [(lambda p: None, "(missing)"), (lambda p: p.write_text("x"), "(not a folder"),
                                        (lambda p: p.mkdir(), "(not readable")])
def test_show_says_why_a_config_root_gives_nothing(tmp_path, monkeypatch, capsys, make, note):
    import os
    import pathlib

    root = tmp_path / "configs"
    make(root)
    monkeypatch.setenv("PDLAB_CONFIG_DIR", str(root))
    if note == "(not readable":  # as a user without read access (root, who runs CI, reads every folder)
        access, iterdir = os.access, pathlib.Path.iterdir

        def denied(path):
            if str(path) == str(root):
                raise PermissionError(13, "Permission denied", str(path))
            return iterdir(path)

        monkeypatch.setattr(os, "access", lambda p, mode, **kw: str(p) != str(root) and access(p, mode, **kw))
        monkeypatch.setattr(pathlib.Path, "iterdir", denied)
    assert main(["show"]) == 0  # a traceback (PermissionError) before
    out = capsys.readouterr().out.replace("\n", "")
    assert f"{root} {note}" in out


def test_show_of_a_device_without_files_names_the_stored_ones(capsys):
    assert main(["show", "--geomean", "--device", "NVIDIA_H20"]) == 0  # a typo of the shipped NVIDIA_H200
    out = capsys.readouterr().out.replace("\n", "")
    assert "no tuned-config files for NVIDIA_H20" in out and "files are stored for: NVIDIA_H200" in out


@needs_cpu_only
def test_buckets_no_usable_backend_takes_exit_1_saying_why(tmp_path, capsys, monkeypatch):
    # `tune moe --arch cpu --only payload=nvfp4`: torch_grouped takes bf16 activations only, so nothing was searched;
    # the run said "nothing stored; tuning took 0.0 s" and exited 0
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["moe", "--arch", "cpu", "--only", "tokens_per_expert=1", "--only", "payload=nvfp4",
                 "--store", str(tmp_path / "st"), "--out", str(tmp_path / "out"), "--budget", "5s",
                 "--no-progress"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("tune moe: moe_experts: none of the backends that run on this cpu device (torch_grouped)")
    assert "--dry-run --arch cpu" in line and not (tmp_path / "st" / "cpu" / "moe_experts.json").exists()


@pytest.mark.parametrize("flag", ["--budget", "--bucket-budget"])
def test_a_bad_duration_names_its_flag(capsys, flag):
    # both flags said "duration '10x': ...", so a run given both did not say which one to fix
    assert main(["attention", "--arch", "sm90", "--dry-run", flag, "10x"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"tune attention: {flag} '10x': ") and "90s, 10m, 1h" in line


_MLA = dict(num_attention_heads=8, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, n_routed_experts=8,
            num_experts_per_tok=2)


@pytest.mark.parametrize("dry", [True, False])
@pytest.mark.parametrize("hidden, inter, field", [(250, 128, "hidden_size=250"),
                                                  (256, 120, "moe_intermediate_size=120")])
def test_tune_moe_model_sizes_nvfp4_cannot_hold_exit_2_naming_them(tmp_path, capsys, dry, hidden, inter, field):
    # planned as any other model; the search then failed every bucket's inputs on a ShapeError from quantizing the
    # NVFP4 expert weights, printed once per bucket, and exited 1 with nothing stored
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(_MLA, hidden_size=hidden, moe_intermediate_size=inter)))
    argv = ["moe", "--arch", "cpu", "--model", str(cfg), "--storage", str(tmp_path / "t.db"), "--store",
            str(tmp_path / "store"), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv + (["--dry-run"] if dry else [])) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert line.startswith(f"tune moe: --model {str(cfg)!r}") and field in line and "multiple of 16" in line
    assert out == "" and not (tmp_path / "store").exists()


def test_tune_attention_takes_a_model_whose_moe_sizes_nvfp4_cannot_hold(tmp_path, capsys):
    # attention tunes at the MLA sizes only: the MoE sizes of the config are no reason to refuse it
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(_MLA, hidden_size=250, moe_intermediate_size=120)))
    assert main(["attention", "--arch", "sm90", "--dry-run", "--model", str(cfg)]) == 0


def test_a_model_file_missing_sizes_is_named_by_the_flag(tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 256}))
    assert main(["moe", "--arch", "sm90", "--dry-run", "--model", str(cfg)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"tune moe: --model {cfg}: missing num_attention_heads")


@pytest.mark.parametrize("ep", ["1", "2"])
@pytest.mark.parametrize("dry", [True, False])
@pytest.mark.parametrize("hidden, says", [(144, "hidden_size=144 is not a multiple of 128: fp8 dispatch"),
                                          (136, "hidden_size=136 is not a multiple of 16: nvfp4 dispatch")])
def test_tune_dispatch_hidden_size_a_payload_cannot_carry_exits_2_naming_it(tmp_path, capsys, dry, ep, hidden, says):
    # planned as any other model; the search then failed every fp8 (and nvfp4) bucket at run time, once per bucket,
    # and stored the bf16 ones
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(_MLA, hidden_size=hidden, moe_intermediate_size=64)))
    argv = ["dispatch", "--arch", "cpu", "--model", str(cfg), "--ep", ep, "--storage", str(tmp_path / "t.db"),
            "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"), "--no-progress", "--trials", "1"]
    assert main(argv + (["--dry-run"] if dry else [])) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert line.startswith(f"tune dispatch: --model {str(cfg)!r}") and says in line
    assert out == "" and not (tmp_path / "store").exists() and not (tmp_path / "out").exists()


def test_tune_dispatch_tunes_the_payloads_a_hidden_size_fits_when_only_those_are_asked_for(tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(_MLA, hidden_size=144, moe_intermediate_size=64)))
    argv = ["dispatch", "--arch", "cpu", "--model", str(cfg), "--dry-run"]
    assert main(argv) == 2
    assert "(--only payload=bf16,nvfp4)" in capsys.readouterr().err
    assert main(argv + ["--only", "payload=bf16,nvfp4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "payload: bf16, nvfp4" in out and "hidden: 144" in out
