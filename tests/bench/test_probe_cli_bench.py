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
