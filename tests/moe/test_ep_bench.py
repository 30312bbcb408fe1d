"""`bench moe` on the CPU: small shape, reference backends, ranks spawned by the command itself."""

import argparse
import json

import pandas as pd
import pytest

from pdlab.bench import moe as bench_moe


def _args(tmp_path, *argv, plot=False):
    p = argparse.ArgumentParser()
    bench_moe.add_arguments(p)
    no_plot = [] if plot else ["--no-plot"]
    return p.parse_args([*argv, "--out", str(tmp_path), "--repeats", "2", "--warmup", "1", *no_plot])


def test_bench_moe_ep2_on_gloo_writes_rows_ratios_and_errors(tmp_path, capsys):
    rc = bench_moe.run(_args(tmp_path, "--ep", "2", "--tokens", "8", "--ll-tokens", "4", "--dispatch", "bf16,nvfp4",
                             "--runner", "torch,torch_grouped", "--mode", "both"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "CPU machine: small shape" in printed and "unavailable here: moe_dispatch[deepep]" in printed
    df = pd.read_csv(tmp_path / "moe_ep2.csv")
    ok = df[df.status == "ok"]
    assert len(df) == 8 and len(ok) == 6  # torch_grouped cannot take nvfp4: listed with the reason
    assert df[df.status != "ok"].status.str.contains("torch_grouped").all()
    for stage in ("route", "quantize", "dispatch", "experts", "combine", "total"):
        assert (ok[f"{stage}_ms"] > 0).all()
    assert (ok.dispatch_MB > 0).all() and (ok.combine_MB > 0).all()
    nv, bf = ok[ok.payload == "nvfp4"], ok[(ok.payload == "bf16") & (ok.runner == "torch")]
    assert (nv.dispatch_MB.values < bf.dispatch_MB.values / 2).all()  # nvfp4 rows are ~3.6x smaller
    assert (ok[ok.payload == "bf16"].cos_err < 1e-4).all() and (nv.cos_err < 5e-2).all()
    meta = json.loads((tmp_path / "moe_ep2.json").read_text())["meta"]
    assert {r["mode"] for r in meta["dispatch_combine_ratio_vs_bf16"]} == {"normal", "low_latency"}


def test_bench_moe_rejects_local_dispatch_across_ranks(tmp_path, capsys):
    assert bench_moe.run(_args(tmp_path, "--ep", "2", "--dispatcher", "local")) == 2
    assert "nccl or deepep" in capsys.readouterr().out


def test_bench_moe_takes_an_hf_config_file(tmp_path):
    cfg = {"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
           "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
           "norm_topk_prob": True, "n_shared_experts": 1}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert bench_moe.run(_args(tmp_path, "--model", str(path), "--tokens", "3", "--mode", "normal",
                               "--dispatch", "bf16")) == 0
    meta = json.loads((tmp_path / "moe_ep1.json").read_text())["meta"]
    assert meta["plan"]["cfg"]["num_experts"] == 8 and meta["plan"]["cfg"]["hidden_size"] == 64


@pytest.mark.parametrize("content, says", [
    (json.dumps({"model_type": "llama", "hidden_size": 64}), "not a DeepseekV3-style MoE config"),
    ("not json {", "not a JSON config file"),
    (None, "no such file or folder"),  # a path that does not exist is named as missing
])
def test_bench_moe_bad_model_is_one_line_and_exit_2(tmp_path, capsys, content, says):
    path = tmp_path / "cfg" / "config.json"
    if content is not None:
        path.parent.mkdir()
        path.write_text(content)
    assert bench_moe.run(_args(tmp_path, "--model", str(path))) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"bench moe: --model {str(path)!r}: ") and says in out and "Traceback" not in out


@pytest.mark.parametrize("argv, says", [
    (("--runner", "torch,tritn"), "moe_experts has no backend named 'tritn'; registered: cutedsl, torch, "
                                  "torch_grouped, triton"),
    (("--ep", "2", "--dispatcher", "mpi"), "moe_dispatch has no backend named 'mpi'; registered: deepep, local, nccl"),
    (("--ep", "3"), "--ep 3 does not divide the model's 16 experts"),  # the CPU shape has 16
])
def test_bench_moe_rejects_what_cannot_run_before_starting(tmp_path, capsys, argv, says):
    assert bench_moe.run(_args(tmp_path, *argv)) == 2
    assert says in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_bench_moe_fails_when_no_row_ran(tmp_path, capsys):
    # torch_grouped takes bf16 activations only: every nvfp4 row is skipped with its reason, and the exit code says so
    assert bench_moe.run(_args(tmp_path, "--runner", "torch_grouped", "--dispatch", "nvfp4", "--tokens", "2",
                               "--mode", "normal")) == 1
    out = capsys.readouterr().out
    assert "skipped normal t2 nvfp4 torch_grouped" in out and "no configuration ran" in out


def test_scaling_plot_from_result_csvs(tmp_path):
    rows = [dict(mode=m, tokens=t, payload=p, runner="triton", ep=ep, status="ok", dispatch_ms=1.0 * ep,
                 combine_ms=0.5, dispatch_GBps=10.0 * ep, combine_GBps=5.0)
            for ep in (2, 4) for m, t in (("normal", 4096), ("low_latency", 128)) for p in ("bf16", "nvfp4")]
    paths = []
    for ep in (2, 4):
        path = tmp_path / f"moe_ep{ep}.csv"
        pd.DataFrame([r for r in rows if r["ep"] == ep]).to_csv(path, index=False)
        paths.append(str(path))
    assert bench_moe.run(_args(tmp_path, "--scaling", *paths, plot=True)) == 0
    out = pd.read_csv(tmp_path / "moe_ep_scaling.csv")
    assert sorted(out.ep.unique()) == [2, 4] and (tmp_path / "moe_ep_scaling.png").stat().st_size > 0
    (tmp_path / "moe_ep_scaling.png").unlink()
    assert bench_moe.run(_args(tmp_path, "--scaling", *paths)) == 0  # --no-plot: the CSV alone
    assert (tmp_path / "moe_ep_scaling.csv").exists() and not (tmp_path / "moe_ep_scaling.png").exists()


def test_only_sync_free_low_latency_paths_are_timed_as_a_cuda_graph():
    from types import SimpleNamespace as NS

    from pdlab.moe.dispatch import create_dispatcher

    assert bench_moe._graph_safe(create_dispatcher("local", 8, 64, mode="low_latency"))
    assert not bench_moe._graph_safe(create_dispatcher("local", 8, 64, mode="normal"))  # counts read back
    assert bench_moe._graph_safe(NS(name="nccl", mode="low_latency", config={"ll_exchange": "fixed"}))
    assert not bench_moe._graph_safe(NS(name="nccl", mode="low_latency", config={"ll_exchange": "counts"}))
    assert not bench_moe._graph_safe(NS(name="deepep", mode="low_latency", config={}))  # not verified
    assert not bench_moe._graph_safe(None)


def test_ratios_report_the_graph_times_when_every_row_has_them():
    rows = [dict(mode="low_latency", tokens=128, payload=p, status="ok", dispatch_ms=d, combine_ms=c,
                 dispatch_combine_graph_ms=g) for p, d, c, g in (("bf16", 0.9, 0.2, 0.3), ("nvfp4", 1.9, 0.2, 0.2))]
    (r,) = bench_moe._ratios(pd.DataFrame(rows))
    assert r["ratio"] == pytest.approx(2.1 / 1.1) and r["graph_ratio"] == pytest.approx(0.2 / 0.3)
    rows[0]["dispatch_combine_graph_ms"] = float("nan")  # one row without a graph time: no graph ratio
    (r,) = bench_moe._ratios(pd.DataFrame(rows))
    assert "graph_ratio" not in r


def test_bench_moe_rows_say_which_dispatch_config_ran(tmp_path, monkeypatch):
    from pdlab.kernels import tuned
    from pdlab.tuning import store

    # a tuned entry for the CPU shape's normal-mode bf16 dispatch (16 experts, top-4, hidden 256): those rows run
    # it; the low-latency rows have no entry and run the default
    bucket = {"tokens_per_rank": 8, "ranks": 1, "mode": "normal", "payload": "bf16", "hidden": 256, "experts": 16,
              "top_k": 4}
    meta = {"device": "cpu", "device_key": "cpu", "arch": "cpu", "versions": tuned.running_versions(["torch"])}
    store.write_results(tmp_path / "cfg", "cpu", "moe_dispatch", meta,
                        store.merge_bucket(bucket, {"local": store.backend_result({"chunk_rows": 2048}, 1.0, 2.0)}))
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(tmp_path / "cfg"))
    tuned.clear_cache()
    try:
        assert bench_moe.run(_args(tmp_path, "--tokens", "8", "--ll-tokens", "4", "--dispatch", "bf16",
                                   "--runner", "torch", "--mode", "both")) == 0
    finally:
        tuned.clear_cache()
    df = pd.read_csv(tmp_path / "moe_ep1.csv").set_index("mode")
    assert df.loc["normal", "dispatch_config"] == "tuned" and "2048" in df.loc["normal", "dispatch_config_detail"]
    assert df.loc["low_latency", "dispatch_config"] == "default"
