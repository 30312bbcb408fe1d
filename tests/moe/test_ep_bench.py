"""`bench moe` on the CPU: small shape, reference backends, ranks spawned by the command itself."""

import argparse
import json

import pandas as pd
import pytest

from pdlab.bench import moe as bench_moe


def _args(tmp_path, *argv):
    p = argparse.ArgumentParser()
    bench_moe.add_arguments(p)
    return p.parse_args([*argv, "--out", str(tmp_path), "--no-plot", "--repeats", "2", "--warmup", "1"])


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
