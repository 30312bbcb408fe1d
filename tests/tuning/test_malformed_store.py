"""A store file of the right outline whose parts are not objects, or whose times are not finite numbers >= 0
(hand-edited, from another tool): the ops skip it with a warning, `tune show` names it, the tuner sets it aside.
It crashed every mla_decode call and `tune show`."""

import json
import logging

import pytest
import torch

from pdlab.kernels import tuned
from pdlab.tuning import store

BROKEN = {
    "metadata": {"format": 1, "op": "mla_decode", "metadata": [], "entries": {}},
    "entries": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"}, "entries": [1, 2]},
    "entry": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"}, "entries": {"x": 5}},
    "backends": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
                 "entries": {"x": {"bucket": {"batch": 2}, "backends": {"torch": 5}}}},
    # values the readers compute with: each crashed `tune show` (or every op's lookup: 'versions')
    "versions": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu", "versions": ["torch"]}, "entries": {}},
    "config": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
               "entries": {"x": {"bucket": {"batch": 2}, "backend": "torch", "backends": {"torch": {"config": [1]}}}}},
    "time": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
             "entries": {"x": {"bucket": {"batch": 2}, "backend": "torch",
                               "backends": {"torch": {"config": {}, "time_ms": "fast"}}}}},
    "speedup": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
                "entries": {"x": {"bucket": {"batch": 2}, "backend": "torch", "speedup": -1.0,
                                  "backends": {"torch": {"config": {}, "time_ms": 1.0, "speedup": -1.0}}}}},
    "infinite": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
                 "entries": {"x": {"bucket": {"batch": 2}, "backend": "torch", "time_ms": float("inf"),
                                   "backends": {"torch": {"config": {}, "time_ms": float("inf")}}}}},
    "winner": {"format": 1, "op": "mla_decode", "metadata": {"device": "cpu"},
               "entries": {"x": {"bucket": {"batch": 2}, "backend": 5, "backends": {"torch": {"config": {}}}}}},
}


def _write(root, content):
    path = root / "cpu" / "mla_decode.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_read_store_names_the_part_that_is_not_an_object(tmp_path, kind):
    path = _write(tmp_path, BROKEN[kind])
    with pytest.raises(ValueError, match="not a pdlab tuned-config file") as exc:
        tuned.read_store(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_an_op_skips_the_file_and_runs(isolated, kind, caplog):
    from pdlab.attention import mla_decode
    from pdlab.attention.ops import clear_config_cache
    from pdlab.attention.workloads import decode_problem

    _write(isolated / "configs", BROKEN[kind])
    clear_config_cache()  # the op's own cache of lookups made under another PDLAB_CONFIG_DIR
    p = decode_problem([64, 100], 16, 1, 16, torch.bfloat16, device=torch.device("cpu"), seed=0)
    caplog.set_level(logging.WARNING, logger="pdlab.tuned")
    out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref_out, ref_lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, config={})
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert any("not a pdlab tuned-config file" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("geomean", [False, True])
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_tune_show_names_the_file_instead_of_a_traceback(isolated, kind, geomean, capsys):
    from pdlab.tuning.cli import main

    path = _write(isolated / "configs", BROKEN[kind])
    assert main(["show", "--device", "cpu"] + (["--geomean"] if geomean else [])) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "skipped" in out and "not a pdlab tuned-config file" in out and path.name in out


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_the_tuner_sets_the_file_aside_and_writes_its_results(tmp_path, kind):
    path = _write(tmp_path, BROKEN[kind])
    bucket = {"batch": 2, "heads": 16}
    written = store.write_results(tmp_path, "cpu", "mla_decode", {"device": "cpu"},
                                  store.merge_bucket(bucket, {"torch": store.backend_result({}, 1.0, 2.0)}))
    assert written == path
    assert tuned.read_store(path)["entries"][tuned.bucket_label(bucket)]["backend"] == "torch"
    aside = list(path.parent.glob("mla_decode.json.malformed-*"))
    assert len(aside) == 1 and json.loads(aside[0].read_text()) == BROKEN[kind]
