"""Layered config: flags and/or YAML/JSON file, impossible settings rejected with reason and fix."""

import argparse
import json

import pytest

from pdlab.runtime.config import (ConfigError, EngineConfig, SchedulerConfig, ServerConfig, add_config_arguments,
                                  build_config, config_from_args)


def _parse(argv, cls=ServerConfig):
    p = argparse.ArgumentParser()
    add_config_arguments(p, cls)
    return config_from_args(cls, p.parse_args(argv))


def test_layers_extend_each_other():
    assert issubclass(ServerConfig, SchedulerConfig) and issubclass(SchedulerConfig, EngineConfig)
    c = ServerConfig()
    assert c.host == "127.0.0.1" and c.page_size == 64 and c.retract_mode == "backup"
    with pytest.raises(Exception):
        c.page_size = 16  # frozen


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("page-size: 16\nkv_dtype: fp8\nport: 1234\ncuda_graph_bs: [1, 2, 4]\n")
    c = _parse(["--config", str(f), "--port", "4321", "--device", "cpu"])
    assert (c.page_size, c.kv_dtype, c.port, c.cuda_graph_bs) == (16, "fp8", 4321, [1, 2, 4])
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"chunked_prefill_size": 512, "max_prefill_tokens": 1024}))
    c = _parse(["--config", str(j), "--no-overlap-schedule", "--cuda-graph-bs", "1", "8"])
    assert c.chunked_prefill_size == 512 and not c.overlap_schedule and c.cuda_graph_bs == [1, 8]


def test_prefill_server_captures_no_decode_graphs(monkeypatch):
    # a prefill server hands each request off after its first token: capturing decode graphs there only cost
    # start-up time and, with the normal-mode MoE it loads, failed with a warning
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not ServerConfig(device="cuda", role="prefill").use_cuda_graph
    assert ServerConfig(device="cuda", role="decode").use_cuda_graph and ServerConfig(device="cuda").use_cuda_graph
    assert not ServerConfig(device="cuda", disable_cuda_graph=True).use_cuda_graph


def test_boolean_flags_switch_both_ways(tmp_path):
    # the overlap schedule is on by default; --no-overlap-schedule turns it off, also over a file that sets it
    assert ServerConfig().overlap_schedule and _parse([]).overlap_schedule
    assert not _parse(["--no-overlap-schedule"]).overlap_schedule
    f = tmp_path / "c.yaml"
    f.write_text("overlap_schedule: false\n")
    assert not _parse(["--config", str(f)]).overlap_schedule
    assert _parse(["--config", str(f), "--overlap-schedule"]).overlap_schedule


@pytest.mark.parametrize("settings,needle", [
    ({"allocator": "token", "page_size": 16}, "--allocator paged"),
    ({"chunked_prefill_size": 4096, "max_prefill_tokens": 1024}, "--max-prefill-tokens"),
    ({"page_size": 0}, "page_size"),
    ({"page_size": 256}, "page_size"),
    ({"page_size": 48}, "page_size 48 is not a power of two"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"device": "tpu"}, "device"),
    ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"cuda_graph_bs": [512], "max_running_requests": 64}, "cuda_graph_bs"),
    ({"not_a_setting": 1}, "unknown setting; known:"),
    ({"max_running_request": 4}, "max_running_request: unknown setting (did you mean max_running_requests?)"),
    ({"port": 70000}, "port"),
    ({"kv_scale": float("inf")}, "kv_scale: Input should be a finite number"),  # was accepted: every request a 500
])
def test_impossible_settings_are_rejected_with_the_reason(settings, needle):
    with pytest.raises(ConfigError, match="invalid configuration") as e:
        build_config(ServerConfig, **settings)
    assert needle in str(e.value)


def test_cuda_device_without_cuda_is_rejected():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="--device cpu"):
        build_config(EngineConfig, device="cuda")


def test_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(ServerConfig, str(tmp_path / "missing.yaml"))
    f = tmp_path / "bad.json"
    f.write_text("{oops")
    with pytest.raises(ConfigError, match="cannot parse"):
        build_config(ServerConfig, str(f))
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="mapping"):
        build_config(ServerConfig, str(f))


def test_pool_smaller_than_one_request_is_rejected_at_start():
    from pdlab.runtime.engine.engine import Engine
    from pdlab.runtime.engine.testing import load_toy
    m, tok, cfg = load_toy(max_position_embeddings=1024)
    with pytest.raises(ConfigError, match="fewer than one maximal request"):
        Engine(build_config(SchedulerConfig, device="cpu", page_size=64, max_total_tokens=512), m, tok, cfg)


def test_serve_cli_rejects_bad_settings_before_loading(capsys):
    from pdlab.runtime.cli import main
    rc = main(["serve", "--device", "cpu", "--allocator", "token", "--page-size", "64"])
    assert rc == 2
    assert "--allocator paged" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flags", [
    (["--kv-scale", "0.05"], ("--kv-scale", "--kv-dtype fp8")),
    (["--kv-dtype", "bf16", "--kv-scale", "2"], ("--kv-scale", "--kv-dtype fp8")),
    (["--disable-cuda-graph", "--cuda-graph-bs", "1", "2"], ("--cuda-graph-bs", "--disable-cuda-graph")),
    (["--disable-cuda-graph", "--cuda-graph-max-prefill-tokens", "128"],
     ("--cuda-graph-max-prefill-tokens 128", "--disable-cuda-graph")),
    (["--max-total-tokens", "8192", "--mem-fraction-static", "0.5"],
     ("--mem-fraction-static 0.5", "--max-total-tokens")),
    (["--retract-mode", "recompute", "--kv-backup-chunk-pages", "64"],
     ("--kv-backup-chunk-pages 64", "--retract-mode recompute")),
])
@pytest.mark.parametrize("mode", [[], ["--disagg"]], ids=["colocated", "disagg"])
def test_flags_that_would_be_ignored_are_usage_errors(capsys, argv, flags, mode):
    """A flag that the other one makes meaningless is refused in one line naming both (exit 2), not ignored."""
    from pdlab.runtime.cli import main
    rc = main(["serve", "--device", "cpu", *mode, *argv])
    assert rc == 2
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if flags[0] in ln)
    assert all(f in line for f in flags), err


def test_flags_that_agree_are_accepted():
    assert build_config(ServerConfig, kv_dtype="fp8", kv_scale=0.05).kv_scale == 0.05
    assert build_config(ServerConfig, kv_scale=1.0).kv_scale == 1.0  # the default, as a dumped config repeats it
    assert build_config(ServerConfig, disable_cuda_graph=True).cuda_graph_bs is None
    # eager prefill said twice; the pool's size given one way; backup copies chunked as backups are made
    assert build_config(ServerConfig, disable_cuda_graph=True, cuda_graph_max_prefill_tokens=0).disable_cuda_graph
    assert build_config(ServerConfig, max_total_tokens=8192, mem_fraction_static=0.85).max_total_tokens == 8192
    assert build_config(ServerConfig, mem_fraction_static=0.5).mem_fraction_static == 0.5
    assert build_config(ServerConfig, retract_mode="backup", kv_backup_chunk_pages=64).kv_backup_chunk_pages == 64
    assert build_config(ServerConfig, retract_mode="recompute").kv_backup_chunk_pages == 256
    c = build_config(ServerConfig, kv_dtype="fp8", kv_scale=0.5, cuda_graph_bs=[1, 2])
    assert build_config(ServerConfig, **c.model_dump()) == c  # a round trip (the disaggregation launcher's) passes


def test_disagg_flags_are_delegated(monkeypatch, capsys):
    import sys
    import types
    from pdlab.runtime import cli
    seen = {}
    fake = types.ModuleType(cli.DISAGG_LAUNCHER)
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, cli.DISAGG_LAUNCHER, fake)
    assert cli.main(["serve", "--role", "router", "--port", "1"]) == 0
    assert seen["argv"] == ["--role", "router", "--port", "1"]
    monkeypatch.setitem(sys.modules, cli.DISAGG_LAUNCHER, None)  # import fails like a missing module
    assert cli.main(["serve", "--disagg"]) == 2
    assert "not built yet" in capsys.readouterr().err
