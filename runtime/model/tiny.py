"""The embedded default model: a tiny DeepSeek-V3-shaped config with seeded random weights (NVFP4
routed experts) and a small byte-level BPE tokenizer shipped as `tiny_tokenizer.json`, so the
runtime serves and tests with no download, on CPU or GPU.

The shape keeps what pdlab's ops fix (kv_lora_rank 512, qk_rope_head_dim 64: a 576-value latent)
and shrinks the rest. Weights are drawn per tensor on the CPU from (TINY_SEED, name), so the model
is the same on every device."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdlab.runtime.model.config import ModelConfig, RopeConfig

TINY_SEED = 1234
TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
TOKENIZER_VOCAB = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_CONFIG = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                    "add_bos_token": True, "chat_template": CHAT_TEMPLATE}

TINY_CONFIG = ModelConfig(
    vocab_size=TOKENIZER_VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
    qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=1024,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=0, eos_token_ids=(1,), architecture="DeepseekV3ForCausalLM",
)


def load_tiny(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, *, options=None):
    """(model, tokenizer, config) of the embedded default; experts NVFP4 unless options say otherwise
    (options.quantize_experts is forced True: the default model is the NVFP4 one)."""
    from dataclasses import replace

    from pdlab.runtime.model.loader import LoadOptions, RandomSource, build_model

    options = replace(options or LoadOptions(), quantize_experts=True)
    model = build_model(TINY_CONFIG, RandomSource(TINY_CONFIG, TINY_SEED), device, dtype, options=options)
    return model, tiny_tokenizer(), TINY_CONFIG


def tiny_tokenizer():
    """The shipped tokenizer (byte-level BPE, 512 tokens, chat template in TOKENIZER_CONFIG)."""
    from pdlab.runtime.model.tokenizer import Tokenizer

    return Tokenizer(TOKENIZER_FILE.read_text(), TOKENIZER_CONFIG)


def write_tokenizer(path: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json of the tiny tokenizer into a model directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(TOKENIZER_FILE.read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1))


def train_tokenizer_json() -> str:
    """Train the tiny tokenizer from the embedded corpus (how `tiny_tokenizer.json` was made;
    deterministic). Returns the tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.split("\n"), trainer)
    return tok.to_str()


_CORPUS = """\
A serving system answers requests one token at a time. Each request brings a prompt, and the model
reads the whole prompt once in a prefill step, then adds one new token in every decode step.
The attention of DeepSeek models keeps a compressed latent vector for each token instead of full
keys and values, so the cache is small and the decode step reads less memory per token.
Experts in a mixture of experts layer each see only the tokens the router sends to them. The router
scores every expert, keeps the best groups, and picks the top experts inside those groups.
Weights stored in four bits with a scale for every sixteen values take a quarter of the memory of
sixteen bit weights, and the kernels turn them back into numbers just before they multiply.
The scheduler decides which requests run in the next step. When memory runs short it moves some
requests out, saves their cache, and brings them back later without changing what they produce.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
Please write a short story about a robot who learns to paint. Once upon a time there was a robot.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 42.
def main(): return 0; for i in range(10): print(i) # numbers, lists [1, 2, 3] and {"key": "value"}
Questions and answers: what is two plus two? Four. Who wrote this text? The people who built it.
"""
