"""Broken tokenizer files (a corrupt tokenizer.json, a malformed tokenizer_config.json, a chat template that
does not compile) fail at load with one ValueError naming the file, never the tokenizers library's bare
Exception or a 400 on every chat request."""

from __future__ import annotations

import json

import pytest
import torch

from pdlab.runtime.model import LoadOptions, load_model

pytest.importorskip("transformers")
OPTIONS = LoadOptions(attn_backend="torch", moe_runner="torch")


def _load(d):
    return load_model(d, "cpu", torch.float32, options=OPTIONS)


def test_corrupt_tokenizer_json_names_the_file(tiny_ckpt, tmp_path):
    d = tiny_ckpt("single")
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        _load(d)


@pytest.mark.parametrize("text", ["{oops", "[1]"])
def test_malformed_tokenizer_config_names_the_file(tiny_ckpt, tmp_path, text):
    d = tiny_ckpt("single")
    (d / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        _load(d)


def test_chat_template_syntax_error_fails_at_load(tiny_ckpt, tmp_path):
    """A template that cannot compile would turn every chat request into a 400 blaming the client."""
    d = tiny_ckpt("single")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content "
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"chat_template.*tokenizer_config\.json"):
        _load(d)
