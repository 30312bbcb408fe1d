"""Broken weights: a truncated or empty safetensors file, a shard the index misplaces a tensor in, a malformed
index, a missing tensor, a tied config with its own head. Each fails at load with one CheckpointError naming
the file (and tensor), never a bare safetensors exception or a KeyError."""

from __future__ import annotations

import json

import pytest
import torch

from pdlab.runtime.model import CheckpointError, LoadOptions, load_model

pytest.importorskip("transformers")
OPTIONS = LoadOptions(attn_backend="torch", moe_runner="torch")


def _load(d):
    return load_model(d, "cpu", torch.float32, options=OPTIONS)


def test_truncated_single_file_names_the_file(tiny_ckpt, tmp_path):
    d = tiny_ckpt("single")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        _load(d)


def test_empty_weights_file_names_the_file(tiny_ckpt, tmp_path):
    d = tiny_ckpt("single")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        _load(d)


def test_truncated_shard_names_the_shard(tiny_ckpt, tmp_path):
    d = tiny_ckpt("sharded")
    shard = sorted(d.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*(truncated|corrupt)"):
        _load(d)


def test_index_naming_the_wrong_shard_names_tensor_shard_and_index(tiny_ckpt, tmp_path):
    d = tiny_ckpt("sharded")
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    shards = sorted(set(idx["weight_map"].values()))
    name = next(k for k, v in idx["weight_map"].items() if v == shards[1])
    idx["weight_map"][name] = shards[0]
    index.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=rf"{name}.*{shards[0]}.*model\.safetensors\.index\.json"):
        _load(d)


@pytest.mark.parametrize("text", ['{"metadata": {}}', "{", "[]", '{"weight_map": [1]}'])
def test_malformed_index_names_the_index(tiny_ckpt, tmp_path, text):
    d = tiny_ckpt("sharded")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        _load(d)


def test_missing_tensor_names_the_directory_not_a_placeholder(tiny_ckpt, tmp_path):
    d = tiny_ckpt("sharded")
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    idx["weight_map"].pop("model.norm.weight")
    index.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"missing.*model\.norm\.weight") as info:
        _load(d)
    assert "?" not in str(info.value) and str(d) in str(info.value)


def test_tied_config_with_an_lm_head_says_so(tiny_ckpt, tmp_path):
    d = tiny_ckpt("single")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*tie_word_embeddings"):
        _load(d)


def test_valid_checkpoints_still_load(tiny_ckpt_root):
    for name in ("single", "sharded"):
        model, tok, cfg = _load(tiny_ckpt_root / name)
        assert tok is not None and cfg.num_hidden_layers == 2


def test_a_tensor_in_two_files_without_an_index_names_both(tiny_ckpt, tmp_path):
    """Shards without an index (every *.safetensors loaded): a tensor held by two files, e.g. a stale copy of a shard
    left beside a new download, was taken silently from whichever file sorted last."""
    from safetensors.torch import load_file, save_file

    d = tiny_ckpt("sharded")
    (d / "model.safetensors.index.json").unlink()
    shard = sorted(d.glob("model-*.safetensors"))[1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    save_file({name: torch.zeros_like(tensors[name])}, str(d / "zz-stale.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor {name!r} is in both {shard.name} and zz-stale\.safetensors"):
        _load(d)
    (d / "zz-stale.safetensors").unlink()
    _load(d)  # the shards alone load
