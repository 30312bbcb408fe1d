"""A malformed config.json (not JSON, not an object, a field of the wrong type) fails at load with one
ConfigError naming the file and the field, never a bare int() ValueError or an AttributeError."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdlab.runtime.model import ConfigError, LoadOptions, load_model
from pdlab.runtime.model.testing import hf_config, hf_model
from pdlab.runtime.model.tiny import write_tokenizer

pytest.importorskip("transformers")
OPTIONS = LoadOptions(attn_backend="torch", moe_runner="torch")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny fp32 checkpoint with the tiny tokenizer: one file ("single") and sharded ("sharded")."""
    root = tmp_path_factory.mktemp("probe_ckpt")
    hf = hf_model(hf_config(layers=2), seed=5)
    for name, kw in (("single", {}), ("sharded", {"max_shard_size": "200KB"})):
        hf.save_pretrained(root / name, **kw)
        write_tokenizer(root / name)
    return root


def _copy(root, name, tmp_path):
    d = tmp_path / name
    shutil.copytree(root / name, d)
    return d


def _load(d):
    return load_model(d, "cpu", torch.float32, options=OPTIONS)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_malformed_config_json_names_the_file(root, tmp_path, text):
    d = _copy(root, "single", tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config\.json"):
        _load(d)


@pytest.mark.parametrize("key,value", [("vocab_size", "abc"), ("hidden_size", 64.5), ("eos_token_id", "x"),
                                       ("num_hidden_layers", [2])])
def test_config_field_of_wrong_type_names_the_field(root, tmp_path, key, value):
    d = _copy(root, "single", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"config\.json.*{key}.*integer"):
        _load(d)


def test_architectures_as_a_string_is_told_to_be_a_list(root, tmp_path):
    d = _copy(root, "single", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = "DeepseekV3ForCausalLM"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"architectures.*list"):
        _load(d)


@pytest.mark.parametrize("key,value,says", [
    ("n_routed_experts", -1, "n_routed_experts must be >= 0"),
    ("q_lora_rank", 0, "q_lora_rank must be positive, or null"),
    ("eos_token_id", 10**6, "eos_token_id 1000000 is outside the vocabulary"),
    ("moe_intermediate_size", -8, "moe_intermediate_size must be >= 0"),
])
def test_config_values_no_model_can_have_are_named_at_load(root, tmp_path, key, value, says):
    # these loaded, then failed later as an 'unexpected tensor' or a shape mismatch, or never stopped generating
    d = _copy(root, "single", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=says):
        _load(d)
