"""Synthetic DeepSeek-R1-shaped models for benchmarking: full width, few layers, seeded random
weights, NVFP4 routed experts. Served with `--model-path synthetic:deepseek-r1[:LAYERS]` (default 4
layers = 1 dense + 3 MoE); no tokenizer, so clients send token ids (bench serving does)."""

from __future__ import annotations

from dataclasses import replace

import torch

PREFIX = "synthetic:"


def r1_config(num_layers: int = 4, max_position_embeddings: int = 163840):
    """The DeepSeek-R1 shape (hidden 7168, 128 heads, 256 experts top-8, YaRN) with `num_layers` layers."""
    from pdlab.runtime.model.config import ModelConfig, RopeConfig
    if num_layers < 2:
        raise ValueError(f"a synthetic R1 needs >= 2 layers (1 dense + MoE), got {num_layers}")
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=num_layers, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-6, max_position_embeddings=max_position_embeddings,
        rope=RopeConfig(theta=10000.0, kind="yarn", factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0, eos_token_ids=(1,), architecture="DeepseekV3ForCausalLM")


def is_synthetic(path: str | None) -> bool:
    return bool(path) and path.startswith(PREFIX)


def synthetic_config(spec: str):
    """The ModelConfig of spec "synthetic:deepseek-r1[:LAYERS]" (no weights); ValueError naming a bad spec."""
    parts = spec[len(PREFIX):].split(":")
    if parts[0] != "deepseek-r1" or len(parts) > 2:
        raise ValueError(f"unknown synthetic model {spec!r}; use synthetic:deepseek-r1 or synthetic:deepseek-r1:LAYERS")
    try:
        layers = int(parts[1]) if len(parts) == 2 else 4
    except ValueError:
        raise ValueError(f"synthetic model {spec!r}: LAYERS must be an integer") from None
    return r1_config(layers)


def load_synthetic(spec: str, device, dtype=torch.bfloat16, seed: int = 0, options=None):
    """(model, None, config) for spec "synthetic:deepseek-r1[:LAYERS]"; `options` (LoadOptions) as
    for `load_model` (experts are always quantized to NVFP4). A spec whose weights cannot fit the device's
    available memory is refused before anything is drawn (MemoryBudgetError, a ValueError)."""
    from pdlab.runtime.memory.budget import fmt_bytes
    from pdlab.runtime.model.loader import LoadOptions, RandomSource, build_model, check_weights_fit, weight_bytes
    cfg = synthetic_config(spec)
    per_layer = weight_bytes(r1_config(3), dtype, True) - weight_bytes(r1_config(2), dtype, True)
    check_weights_fit(cfg, device, dtype, nvfp4_experts=True, ep_size=(options or LoadOptions()).ep_size,
                      fix=f"ask for fewer layers ({PREFIX}deepseek-r1:LAYERS; each MoE layer takes about "
                          f"{fmt_bytes(per_layer)}), or use a device with more memory")
    src = RandomSource(cfg, seed, gen_device=device)
    model = build_model(cfg, src, device, dtype, options=replace(options or LoadOptions(), quantize_experts=True))
    return model, None, cfg
