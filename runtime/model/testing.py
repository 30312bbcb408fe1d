"""Helpers for model tests (not used when serving): tiny transformers DeepseekV3 checkpoints and a
minimal paged KV that builds ForwardContexts (page size 16, shuffled page ids)."""

from __future__ import annotations

import random

import torch

from pdlab.runtime.context import ForwardContext

PAGE = 16


def hf_config(*, yarn: bool = False, q_lora: bool = True, layers: int = 3, vocab: int = 320,
              all_experts: bool = False):
    """A tiny transformers DeepseekV3Config whose MLA fits pdlab's ops (kv_lora 512, rope 64).
    all_experts: every token uses all 8 experts (top-8 of 4 groups, all groups kept), so the routing
    has no discrete choice that low-precision noise could flip (only the weights vary)."""
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
              n_routed_experts=8, kv_lora_rank=512, q_lora_rank=32 if q_lora else None, qk_rope_head_dim=64,
              v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=4 if all_experts else 2,
              num_experts_per_tok=8 if all_experts else 3,
              first_k_dense_replace=1, max_position_embeddings=2048, rms_norm_eps=1e-6, routed_scaling_factor=2.5,
              bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if yarn:
        kw["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": 8.0,
                              "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    return DeepseekV3Config(**kw)


def hf_model(config, seed: int):
    """A transformers DeepseekV3ForCausalLM (fp32) with every parameter random at a useful scale:
    linear weights N(0, 1/in), norms 1 + N(0, 0.1²), correction bias U(0, 0.1), lm_head ×4 (well
    separated logits, so greedy choices are not near-ties)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                gain = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.rand(b.shape, generator=g))
    return model


class PagedKV:
    """One [pages, 16, 576] pool per layer; each sequence gets pages from a shuffled free list."""

    def __init__(self, num_layers: int, num_pages: int, dtype: torch.dtype, seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.pools = [torch.zeros(num_pages, PAGE, 576, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new: dict[int, int], is_decode: bool,
             logits_all: bool = False) -> tuple[ForwardContext, torch.Tensor]:
        """new: seq id → number of new tokens (in this order). Returns (ctx, positions [T])."""
        slots, positions, seqlens, indptr, logits_idx = [], [], [], [0], []
        for sid, n in new.items():
            start = self.lens.get(sid, 0)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * PAGE < start + n:
                pages.append(self.free.pop())
            for pos in range(start, start + n):
                slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
                positions.append(pos)
            self.lens[sid] = start + n
            seqlens.append(start + n)
            indptr.append(indptr[-1] + n)
            logits_idx.extend(range(indptr[-2], indptr[-1]) if logits_all else [indptr[-1] - 1])
        width = max(len(self.pages[s]) for s in new)
        table = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in new]
        dev = self.device
        ctx = ForwardContext(
            is_decode=is_decode, block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            seqlens=torch.tensor(seqlens, dtype=torch.int32, device=dev),
            qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            kv_caches=self.pools, kv_scale=None, max_q_len=max(new.values()), q_len=1)
        return ctx, torch.tensor(positions, dtype=torch.int64, device=dev)


def write_modelopt_checkpoint(src, dst, quantize_dense: tuple[str, ...] = ()) -> dict:
    """Rewrite an unquantized HF DeepseekV3 checkpoint directory `src` as a modelopt NVFP4 one in
    `dst`: every routed expert's gate/up/down weight → weight (uint8) + weight_scale (e4m3) +
    weight_scale_2 + input_scale, plus the non-expert linears whose names end with one of
    `quantize_dense`; everything else stays as it was. An expert's gate and up share one
    weight_scale_2 (as modelopt exports them). Writes hf_quant_config.json (exclude_modules
    = lm_head) and returns {name: the dequantized fp32 weight} for every quantized tensor."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from pdlab.kernels.nvfp4 import dequantize_nvfp4, quantize_weight_modelopt

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, dequant = {}, {}
    for name, t in tensors.items():
        base = name[: -len(".weight")]
        if not (name.endswith(".weight") and (".mlp.experts." in name or base.endswith(quantize_dense))):
            out[name] = t.contiguous()
            continue
        joint = t.float()
        if base.endswith((".gate_proj", ".up_proj")) and ".mlp.experts." in name:
            # modelopt gives an expert's gate and up one shared weight_scale_2 (they run as one GEMM)
            stem = base.rsplit(".", 1)[0]
            joint = torch.cat([tensors[stem + ".gate_proj.weight"], tensors[stem + ".up_proj.weight"]]).float()
        q = quantize_weight_modelopt(joint)
        rows = slice(None)
        if joint.shape[0] != t.shape[0]:
            n = t.shape[0]
            rows = slice(0, n) if base.endswith(".gate_proj") else slice(n, 2 * n)
        packed, scale = q["weight"][rows].contiguous(), q["weight_scale"][rows].contiguous()
        out[name], out[base + ".weight_scale"] = packed, scale
        out[base + ".weight_scale_2"] = q["weight_scale_2"].reshape(())
        out[base + ".input_scale"] = torch.tensor(8.0 / (6 * 448), dtype=torch.float32)
        dequant[name] = dequantize_nvfp4(packed, scale, 1.0 / q["weight_scale_2"])
    save_file(out, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    quant = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                              "exclude_modules": ["lm_head"]}}
    (dst / "hf_quant_config.json").write_text(json.dumps(quant))
    return dequant
