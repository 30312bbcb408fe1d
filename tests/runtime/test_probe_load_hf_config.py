"""A malformed config.json (not JSON, not an object, a field of the wrong type) fails at load with one
ConfigError naming the file and the field, never a bare int() ValueError or an AttributeError."""

from __future__ import annotations

import json

import pytest
import torch

from pdlab.runtime.model import ConfigError, LoadOptions, load_model

pytest.importorskip("transformers")
OPTIONS = LoadOptions(attn_backend="torch", moe_runner="torch")


def _load(d):
    return load_model(d, "cpu", torch.float32, options=OPTIONS)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_malformed_config_json_names_the_file(tiny_ckpt, tmp_path, text):
    d = tiny_ckpt("single")
    (d / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config\.json"):
        _load(d)


@pytest.mark.parametrize("key,value", [("vocab_size", "abc"), ("hidden_size", 64.5), ("eos_token_id", "x"),
                                       ("num_hidden_layers", [2])])
def test_config_field_of_wrong_type_names_the_field(tiny_ckpt, tmp_path, key, value):
    d = tiny_ckpt("single")
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"config\.json.*{key}.*integer"):
        _load(d)


def test_architectures_as_a_string_is_told_to_be_a_list(tiny_ckpt, tmp_path):
    d = tiny_ckpt("single")
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
def test_config_values_no_model_can_have_are_named_at_load(tiny_ckpt, tmp_path, key, value, says):
    # these loaded, then failed later as an 'unexpected tensor' or a shape mismatch, or never stopped generating
    d = tiny_ckpt("single")
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=says):
        _load(d)
