"""The checkpoint loader: sharded safetensors, modelopt NVFP4, tokenizer files, MTP layers, and the
errors for missing files / unknown architectures / wrong, missing or unexpected tensors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdlab.runtime.model import CheckpointError, ConfigError, LoadOptions, load_model
from pdlab.runtime.model.testing import PagedKV, hf_config, hf_model, write_modelopt_checkpoint
from pdlab.runtime.model.tiny import write_tokenizer

pytest.importorskip("transformers")
OPTIONS = LoadOptions(attn_backend="torch", moe_runner="torch")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny fp32 transformers checkpoint (3 layers, 8 experts), its model, and a sharded copy."""
    root = tmp_path_factory.mktemp("ckpt")
    hf = hf_model(hf_config(), seed=5)
    hf.save_pretrained(root / "single")
    hf.save_pretrained(root / "sharded", max_shard_size="200KB")
    return hf, root


def _logits(model, cfg, ids, dtype=torch.float32):
    kv = PagedKV(cfg.num_hidden_layers, num_pages=4, dtype=dtype)
    ctx, pos = kv.step({0: len(ids)}, is_decode=False, logits_all=True)
    return model(torch.tensor(ids), pos, ctx)


def _copy(src, dst, edit=None, config_edit=None):
    """Copy a single-file checkpoint, editing its tensors dict and/or config dict."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


IDS = [5, 17, 200, 3, 99, 250, 31, 8, 64, 128, 7]


def test_sharded_equals_single(ckpt):
    _, root = ckpt
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    a, _, cfg = load_model(root / "single", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    b, _, _ = load_model(root / "sharded", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    assert torch.equal(_logits(a, cfg, IDS), _logits(b, cfg, IDS))


def test_nvfp4_modelopt_checkpoint(ckpt, tmp_path):
    """Experts (and one dense o_proj) in NVFP4: the loaded model computes with exactly the dequantized
    weights, i.e. it matches the bf16 checkpoint whose quantized tensors are replaced by their
    dequantized values."""
    _, root = ckpt
    dequant = write_modelopt_checkpoint(root / "single", tmp_path / "fp4",
                                        quantize_dense=("layers.1.self_attn.o_proj",))
    model, _, cfg = load_model(tmp_path / "fp4", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert cfg.quant is not None and cfg.quant.algo == "NVFP4" and cfg.quant.exclude_modules == ("lm_head",)
    w = model.model.layers[1].mlp.moe.weights
    assert w.has_nvfp4 and not w.has_bf16 and w.w13_weight.shape == (8, 64, 32)
    dq_dir = _copy(root / "single", tmp_path / "dq", edit=lambda t: t.update(dequant))
    ref, _, _ = load_model(dq_dir, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, ref.model.layers[1].self_attn.o_proj.weight)
    got, want = _logits(model, cfg, IDS), _logits(ref, cfg, IDS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # and the quantization is real: the unquantized checkpoint gives visibly different logits
    plain, _, _ = load_model(root / "single", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert (got - _logits(plain, cfg, IDS)).abs().max() > 1e-3


def test_nvfp4_expert_missing_scale(ckpt, tmp_path):
    _, root = ckpt
    write_modelopt_checkpoint(root / "single", tmp_path / "fp4")
    t = load_file(str(tmp_path / "fp4" / "model.safetensors"))
    del t["model.layers.2.mlp.experts.3.down_proj.weight_scale"]
    save_file(t, str(tmp_path / "fp4" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj.*weight_scale"):
        load_model(tmp_path / "fp4", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_mtp_layers_are_skipped(ckpt, tmp_path, caplog):
    _, root = ckpt
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    d = _copy(root / "single", tmp_path / "mtp", edit=lambda t: t.update(extra))
    with caplog.at_level(logging.INFO, logger="pdlab.runtime.model"):
        model, _, cfg = load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert "skipped checkpoint layers [3]" in caplog.text
    ref, _, _ = load_model(root / "single", "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert torch.equal(_logits(model, cfg, IDS), _logits(ref, cfg, IDS))


def test_tokenizer_files(ckpt, tmp_path):
    _, root = ckpt
    # config.json names a second end-of-sequence id besides the tokenizer's own <|eos|> (id 1)
    d = _copy(root / "single", tmp_path / "tok", config_edit=lambda c: c.update(eos_token_id=[1, 5]))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(d, "cpu", torch.float32, options=OPTIONS)
    write_tokenizer(d)
    _, tok, _ = load_model(d, "cpu", torch.float32, options=OPTIONS)
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "Hello world"
    assert tok.eos_token_ids == (1, 5)  # the tokenizer's EOS, then config.json's other one


@pytest.mark.parametrize("case", ["no_dir", "no_config", "no_weights", "missing_shard"])
def test_missing_files(ckpt, tmp_path, case):
    _, root = ckpt
    d = tmp_path / "m"
    if case == "no_dir":
        d, match = tmp_path / "nope", "not a directory"
    elif case == "no_config":
        d.mkdir()
        match = "config.json not found in"
    elif case == "no_weights":
        d.mkdir()
        (d / "config.json").write_text((root / "single" / "config.json").read_text())
        match = "no weights in .*model.safetensors"
    else:
        import shutil

        shutil.copytree(root / "sharded", d)
        victim = sorted(d.glob("model-*.safetensors"))[0]
        victim.unlink()
        match = f"names shard.*{victim.name}"
    with pytest.raises(FileNotFoundError, match=match):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_unknown_architecture(ckpt, tmp_path):
    _, root = ckpt
    d = _copy(root / "single", tmp_path / "arch",
              config_edit=lambda c: c.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2"))
    with pytest.raises(ConfigError, match="unknown architecture.*DeepseekV2ForCausalLM.*DeepseekV3ForCausalLM"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_wrong_shape_names_tensor_expected_and_got(ckpt, tmp_path):
    _, root = ckpt
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    d = _copy(root / "single", tmp_path / "shape", edit=lambda t: t.update({name: torch.zeros(96, 512)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \[96, 512\].*expects \[128, 512\]"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    # a config that disagrees with the weights (more heads) is caught the same way
    d2 = _copy(root / "single", tmp_path / "heads", config_edit=lambda c: c.update(num_attention_heads=8,
                                                                                  num_key_value_heads=8))
    with pytest.raises(CheckpointError,
                       match=r"self_attn\.\w+\.weight' in .* has shape \[\d+, \d+\] but the config expects"):
        load_model(d2, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: no lm_head tensor in the checkpoint; the head reuses embed_tokens."""
    config = hf_config(layers=2)
    config.tie_word_embeddings = True
    hf = hf_model(config, seed=9)
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model, _, cfg = load_model(tmp_path, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)[None]).logits[0]
    torch.testing.assert_close(_logits(model, cfg, IDS), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_fp8_weights_are_refused(ckpt, tmp_path):
    _, root = ckpt
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight"):
        d = _copy(root / "single", tmp_path / name.split(".")[4],
                  edit=lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
        with pytest.raises(CheckpointError, match=rf"{name}.*float8_e4m3fn"):
            load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_missing_and_unexpected_tensors(ckpt, tmp_path):
    _, root = ckpt
    d = _copy(root / "single", tmp_path / "missing", edit=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    d = _copy(root / "single", tmp_path / "expert",
              edit=lambda t: t.pop("model.layers.2.mlp.experts.7.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*experts\.7\.gate_proj\.weight"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    d = _copy(root / "single", tmp_path / "extra",
              edit=lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)
    d = _copy(root / "single", tmp_path / "extra_expert",
              edit=lambda t: t.update({"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*experts\.8\.up_proj"):
        load_model(d, "cpu", torch.float32, options=OPTIONS, require_tokenizer=False)


def test_a_config_too_large_for_the_device_fails_before_the_model_is_built(tiny_ckpt, monkeypatch):
    """A config.json of absurd sizes (a typo'd layer count, say) built the model first: with 10**7 layers that is a
    hang, then an out-of-memory. The weights' size is estimated from the config and compared first."""
    from pdlab.runtime.memory import budget
    from pdlab.runtime.memory.budget import MemoryBudgetError
    from pdlab.runtime.model import loader

    d = tiny_ckpt("single")
    hf = json.loads((d / "config.json").read_text())
    hf["num_hidden_layers"] = 10**7
    (d / "config.json").write_text(json.dumps(hf))

    def not_built(*a, **k):
        raise AssertionError("the model was built before its size was checked")

    monkeypatch.setattr(loader, "DeepseekV3ForCausalLM", not_built)
    monkeypatch.setattr(budget, "available_bytes", lambda device: 16 << 30)
    with pytest.raises(MemoryBudgetError) as e:
        load_model(d, "cpu", torch.float32, options=OPTIONS)
    msg = str(e.value)
    assert msg.startswith("the model weights (10000000 layers, hidden 64, 8 experts of 32, vocab")
    assert "TiB, but cpu has 16.00 GiB available; serve a smaller model" in msg


def test_a_tokenizer_larger_than_the_models_vocabulary_is_reported_at_load(tiny_ckpt, caplog):
    """The tiny tokenizer (512 ids) beside weights of vocab_size 320 loaded silently; then every prompt whose text
    encoded to an id >= 320 was a 400. The load now says so once, with both numbers."""
    d = tiny_ckpt("single")
    with caplog.at_level("WARNING", logger="pdlab.runtime.model"):
        _, tok, cfg = load_model(d, "cpu", torch.float32, options=OPTIONS)
    assert cfg.vocab_size == 320 and tok.max_token_id == 511
    assert "tokenizer.json holds token ids up to 511 but config.json's vocab_size is 320" in caplog.text
