"""ModelConfig normalisation, YaRN rotary / RMSNorm against transformers, the embedded tiny default
(NVFP4 experts, tokenizer, chat template), KV-path consistency (chunked prefill, decode, batching,
fp8 KV) and bad-input errors."""

from __future__ import annotations

import math

import pytest
import torch

from pdlab.runtime.model import ConfigError, LoadOptions, ModelConfig, load_model
from pdlab.runtime.model.layers import RMSNorm, RotaryEmbedding
from pdlab.runtime.model.testing import PagedKV
from pdlab.runtime.model.tiny import TINY_CONFIG, TINY_SEED, TOKENIZER_FILE, tiny_tokenizer, train_tokenizer_json

# The DeepSeek-V3 / R1 config.json (the fields pdlab reads).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "num_nextn_predict_layers": 1,
}


def test_config_deepseek_v3():
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.latent_dim) == (7168, 128, 1536, 576)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and cfg.rope.interleave
    assert cfg.rope.attention_factor == 1.0  # mscale == mscale_all_dim
    mscale = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert cfg.eos_token_ids == (1,) and cfg.num_nextn_predict_layers == 1
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert ModelConfig.from_hf(TINY_CONFIG.to_hf()) == TINY_CONFIG
    # the engine's synthetic speed-test model is R1's shape with fewer layers
    synthetic = pytest.importorskip("pdlab.runtime.engine.synthetic")
    r1_4 = ModelConfig.from_hf({**DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 1,
                                "num_nextn_predict_layers": 0})
    assert synthetic.r1_config(4) == r1_4


def test_config_matches_transformers_scaling():
    """softmax scale and rope attention factor as transformers computes them, for several YaRN settings."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    for rs in ({"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096},
               {"type": "yarn", "factor": 8, "mscale": 0.707, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 512},
               {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}, None):
        d = dict(DEEPSEEK_V3, num_hidden_layers=1, rope_scaling=rs)
        if rs is None:
            d.pop("rope_scaling")
        cfg = ModelConfig.from_hf(d)
        hcfg = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        scale = hf.yarn_apply_mscale(hcfg.rope_parameters, hcfg.qk_head_dim ** -0.5)
        assert cfg.softmax_scale == pytest.approx(scale, rel=1e-12), rs
        rot = hf.DeepseekV3RotaryEmbedding(hcfg)
        assert cfg.rope.attention_factor == pytest.approx(rot.attention_scaling, rel=1e-12), rs
        ours = RotaryEmbedding(64, cfg.rope)
        torch.testing.assert_close(ours.inv_freq, rot.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_matches_transformers(interleave):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    d = dict(DEEPSEEK_V3, num_hidden_layers=1, rope_interleave=interleave)
    cfg = ModelConfig.from_hf(d)
    hcfg = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    pos = torch.tensor([0, 1, 7, 4095, 4096, 50000, 163839])
    q, k = torch.randn(len(pos), 3, 64), torch.randn(len(pos), 1, 64)
    cos, sin = hf.DeepseekV3RotaryEmbedding(hcfg)(q, pos[None])
    apply = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    rq, rk = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # [1, heads, T, 64]
    ours = RotaryEmbedding(64, cfg.rope)
    c, s = ours(pos, torch.float32)
    torch.testing.assert_close(ours.rotate(q, c, s), rq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.rotate(k, c, s), rk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_rmsnorm_matches_transformers_bitwise():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    x = torch.randn(9, 256, dtype=torch.bfloat16) * 3
    ref = DeepseekV3RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    ours = RMSNorm(256, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256))
        ours.weight.copy_(ref.weight)
        assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "unknown architecture"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unknown architecture.*LlamaForCausalLM"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"n_group": 7}, "n_routed_experts 256 must split into n_group 7"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 1}, "num_key_value_heads 1"),
    ({"kv_lora_rank": None}, "lacks 'kv_lora_rank'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8.*convert it to bf16"),
])
def test_config_rejects(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


YARN = dict(DEEPSEEK_V3["rope_scaling"])  # a copy: transformers' config adds rope_theta to the dict it is given


@pytest.mark.parametrize("change,match", [
    # each was accepted before: a context of 0 became 4096 silently, -5 a server that refused every prompt; a YaRN
    # factor of 0 or below and a negative norm epsilon gave NaN / garbage logits (greedy token 0 every step)
    ({"max_position_embeddings": 0}, "max_position_embeddings must be positive.*got 0"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be positive.*got -5"),
    ({"rope_scaling": {**YARN, "factor": 0}}, r"'rope_scaling': YaRN needs a positive factor.*got factor 0,"),
    ({"rope_scaling": {**YARN, "factor": -2}}, "YaRN needs a positive factor.*got factor -2,"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps must be >= 0, got -1.0.*NaN"),
    # each was a bare ValueError / TypeError naming no field ("could not convert string to float: 'abc'",
    # "math domain error", "cannot convert dictionary update sequence element #0 to a sequence")
    ({"rope_scaling": {**YARN, "factor": "abc"}}, r"'rope_scaling\.factor' must be a finite number, got 'abc'"),
    ({"rope_scaling": {**YARN, "mscale": "big"}}, r"'rope_scaling\.mscale' must be a finite number, got 'big'"),
    ({"rope_scaling": YARN, "rope_theta": "x"}, "'rope_theta' must be a finite number, got 'x'"),
    ({"rope_scaling": YARN, "rope_theta": 0}, r"'rope_theta' must be positive \(the rotary base"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "rope_theta": 0}},
     r"'rope_parameters\.rope_theta' must be positive"),
    ({"rope_scaling": [1, 2]}, r"'rope_scaling' must be an object such as .* or null, got \[1, 2\]"),
    ({"rope_parameters": [1]}, r"'rope_parameters' must be an object"),
])
def test_config_rejects_values_that_break_the_model(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


def test_ops_need_576_latent():
    cfg = ModelConfig.from_hf({**DEEPSEEK_V3, "kv_lora_rank": 256})
    with pytest.raises(ConfigError, match="kv_lora_rank 512 and qk_rope_head_dim 64.*576"):
        cfg.check_ops_shape()


# ---------------------------------------------------------------------------------------------
# the embedded default


@pytest.fixture(scope="module")
def tiny():
    """The default model in fp32 with the fp32 reference runners, so paths can be compared tightly."""
    return load_model(None, "cpu", torch.float32, options=LoadOptions(attn_backend="torch", moe_runner="torch"))


def _prefill(model, cfg, seqs: dict[int, list[int]], kv: PagedKV, logits_all=False):
    ctx, pos = kv.step({s: len(t) for s, t in seqs.items()}, is_decode=False, logits_all=logits_all)
    return model(torch.tensor([t for ts in seqs.values() for t in ts]), pos, ctx)


def test_tiny_default(tiny):
    model, tok, cfg = tiny
    assert cfg is TINY_CONFIG and cfg.latent_dim == 576 and tok.vocab_size == cfg.vocab_size
    moe = [layer.mlp.moe for layer in model.model.layers if layer.is_moe]
    assert len(moe) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert all(m.weights.has_nvfp4 and not m.weights.has_bf16 for m in moe), "the default model's experts are NVFP4"
    # the experts were quantized a few at a time at load: same tensors as quantizing the whole stack
    from pdlab.moe.weights import ExpertWeights
    from pdlab.runtime.model.loader import EXPERT_CHUNK, RandomSource

    assert cfg.n_routed_experts > EXPERT_CHUNK
    src, inter = RandomSource(cfg, TINY_SEED), cfg.moe_intermediate_size
    e = range(cfg.n_routed_experts)
    w13 = torch.stack([torch.cat([src.get(f"model.layers.1.mlp.experts.{i}.{p}_proj.weight") for p in ("gate", "up")])
                       for i in e])
    w2 = torch.stack([src.get(f"model.layers.1.mlp.experts.{i}.down_proj.weight") for i in e])
    whole = ExpertWeights.from_bf16(w13, w2, quantize=True, keep_bf16=False)
    for k in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_input_scale"):
        got, want = getattr(moe[0].weights, k), getattr(whole, k)
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), k
    assert w13.shape == (cfg.n_routed_experts, 2 * inter, cfg.hidden_size)
    # seeded: a second load (default runners) gives the same weights
    again, _, _ = load_model(None, "cpu", torch.float32)
    for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), n
    ids = tok.encode("The scheduler decides which requests run.")
    lg = _prefill(model, cfg, {0: ids}, PagedKV(cfg.num_hidden_layers, 8, torch.float32))
    assert lg.shape == (1, cfg.vocab_size) and lg.dtype == torch.float32 and torch.isfinite(lg).all()
    assert lg.std() > 0.5  # not degenerate


def test_tiny_kv_paths_agree(tiny):
    """Same tokens, three ways: one prefill; chunked prefill + decode steps; batched with another
    sequence. The logits of every new token agree (fp32, torch reference attention)."""
    model, tok, cfg = tiny
    ids = tok.encode("Experts in a mixture of experts layer each see only the tokens the router sends.")
    n = len(ids)
    full = _prefill(model, cfg, {0: ids}, PagedKV(cfg.num_hidden_layers, 8, torch.float32), logits_all=True)

    kv = PagedKV(cfg.num_hidden_layers, 8, torch.float32, seed=1)
    parts = [_prefill(model, cfg, {0: ids[:7]}, kv, logits_all=True),
             _prefill(model, cfg, {0: ids[7: n - 3]}, kv, logits_all=True)]
    for t in ids[n - 3:]:
        ctx, pos = kv.step({0: 1}, is_decode=True)
        parts.append(model(torch.tensor([t]), pos, ctx))
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-4, atol=1e-4)

    other = tok.encode("Hello! How are you today?")
    kv = PagedKV(cfg.num_hidden_layers, 16, torch.float32, seed=2)
    both = _prefill(model, cfg, {1: other, 0: ids}, kv)
    torch.testing.assert_close(both[1], full[-1], rtol=1e-4, atol=1e-4)
    alone = _prefill(model, cfg, {0: other}, PagedKV(cfg.num_hidden_layers, 8, torch.float32))
    torch.testing.assert_close(both[0], alone[0], rtol=1e-4, atol=1e-4)


def test_tiny_multi_token_decode(tiny):
    """Decode steps adding q_len = 2 tokens per sequence (speculative decoding's shape) give the same
    logits as prefilling those tokens."""
    model, tok, cfg = tiny
    a = tok.encode("The router scores every expert and keeps the best groups.")
    b = tok.encode("Once upon a time there was a robot.")
    ref_a = _prefill(model, cfg, {0: a}, PagedKV(cfg.num_hidden_layers, 8, torch.float32), logits_all=True)
    ref_b = _prefill(model, cfg, {0: b}, PagedKV(cfg.num_hidden_layers, 8, torch.float32), logits_all=True)
    kv = PagedKV(cfg.num_hidden_layers, 16, torch.float32, seed=3)
    _prefill(model, cfg, {0: a[:-2], 1: b[:-2]}, kv)
    ctx, pos = kv.step({0: 2, 1: 2}, is_decode=True, logits_all=True)
    ctx.q_len = 2
    got = model(torch.tensor(a[-2:] + b[-2:]), pos, ctx)
    torch.testing.assert_close(got, torch.cat([ref_a[-2:], ref_b[-2:]]), rtol=1e-4, atol=1e-4)


def test_tiny_fp8_kv(tiny, monkeypatch):
    """An fp8 pool (uint8 e4m3 bytes + kv_scale): the model writes and reads the latent through it.
    The result equals a float pool fed with the e4m3 round trip of each latent row (so the model
    passes kv_scale through both phases correctly), and stays near the unquantized run (a few %,
    except where the perturbation flips an expert choice)."""
    import pdlab.attention as attention
    from pdlab.attention.kv import dequantize_kv_fp8, quantize_kv_fp8

    model, tok, cfg = tiny
    ids = tok.encode("Weights stored in four bits with a scale for every sixteen values.")

    def run(fp8: bool, scale=None):
        kv = PagedKV(cfg.num_hidden_layers, 8, torch.float32)
        if fp8:
            kv.pools = [torch.zeros(8, 16, 576, dtype=torch.uint8) for _ in kv.pools]
        ctx, pos = kv.step({0: len(ids) - 1}, is_decode=False, logits_all=True)
        ctx.kv_scale = scale
        pre = model(torch.tensor(ids[:-1]), pos, ctx)
        ctx, pos = kv.step({0: 1}, is_decode=True)
        ctx.kv_scale = scale
        return torch.cat([pre, model(torch.tensor(ids[-1:]), pos, ctx)]), kv

    ref, ref_kv = run(False)
    scale = max(float(p.abs().max()) for p in ref_kv.pools) / 448  # no saturation
    got, kv = run(True, scale)
    assert all(p.any() for p in kv.pools), "latent rows were not written into the fp8 pools"

    store = attention.store_kv
    monkeypatch.setattr(attention, "store_kv", lambda cache, slots, latent, kv_scale=None: store(
        cache, slots, dequantize_kv_fp8(quantize_kv_fp8(latent, scale), scale), kv_scale=None))
    emulated, _ = run(False)
    torch.testing.assert_close(got, emulated, rtol=1e-5, atol=1e-5)
    err = (got - ref).abs().amax(-1) / ref.abs().max()
    assert 0 < float(err.median()) < 0.1, err


def test_forward_rejects_bad_context(tiny):
    model, tok, cfg = tiny
    kv = PagedKV(cfg.num_hidden_layers, 8, torch.float32)
    ctx, pos = kv.step({0: 4}, is_decode=False)
    ids = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match="one slot per new token"):
        model(ids[:3], pos[:3], ctx)
    with pytest.raises(ValueError, match="1-D, same length"):
        model(ids[None], pos[None], ctx)
    ctx.kv_caches = ctx.kv_caches[:2]
    with pytest.raises(ValueError, match="one pool per layer"):
        model(ids, pos, ctx)
    ctx, pos = kv.step({0: 2}, is_decode=True)
    with pytest.raises(ValueError, match="q_len"):
        model(torch.tensor([5, 6]), pos, ctx)


def test_tokenizer_asset_and_chat_template():
    assert TOKENIZER_FILE.stat().st_size < 500_000
    assert TOKENIZER_FILE.read_text() == train_tokenizer_json(), "tiny_tokenizer.json no longer matches its recipe"
    tok = tiny_tokenizer()
    text = "Hello! The robot paints 42 pictures."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0 and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == "<|bos|><|system|>Be brief.<|user|>Hi<|assistant|>"
    chat_ids = tok.encode_chat(msgs)
    assert chat_ids[0] == tok.bos_token_id and chat_ids.count(tok.bos_token_id) == 1
    assert tok.token_to_id("<|assistant|>") == chat_ids[-1]
    assert tok.eos_token_ids == (1,)
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.gpu
def test_tiny_on_gpu_matches_cpu(tiny):
    """The default model on CUDA (bf16, default backends: triton attention and MoE where available)
    against the CPU fp32 reference run: same weights, logits within bf16 + NVFP4 tolerance."""
    model, tok, cfg = tiny
    gpu, _, _ = load_model(None, "cuda", torch.bfloat16)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    ref = _prefill(model, cfg, {0: ids}, PagedKV(cfg.num_hidden_layers, 8, torch.float32), logits_all=True)
    kv = PagedKV(cfg.num_hidden_layers, 8, torch.bfloat16, device="cuda")
    ctx, pos = kv.step({0: len(ids)}, is_decode=False, logits_all=True)
    got = gpu(torch.tensor(ids, device="cuda"), pos, ctx).cpu()
    err = (got - ref).abs().amax(-1) / ref.abs().max()
    assert float(err.median()) < 5e-2, err
    ctx, pos = kv.step({0: 1}, is_decode=True)
    assert torch.isfinite(gpu(torch.tensor([ids[-1]], device="cuda"), pos, ctx)).all()


def test_profile_stages(tmp_path):
    """The stage profiler covers every stage of a forward and writes its CSVs."""
    import pandas as pd

    from pdlab.runtime.model import profile

    assert profile.main(["--device", "cpu", "--batch", "2", "--prefill", "8", "--context", "20",
                         "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    stages = pd.read_csv(tmp_path / "stages.csv")
    for phase in ("decode", "prefill"):
        rows = stages[stages.phase == phase]
        assert set(rows.stage) == {"embed", "attention", "dense_mlp", "moe", "head"}
        assert abs(rows.share.sum() - 1) < 1e-3
    fwd = pd.read_csv(tmp_path / "forward.csv")
    assert list(fwd.tokens) == [2, 8] and (fwd.ms > 0).all()
