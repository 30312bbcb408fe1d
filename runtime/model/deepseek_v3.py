"""DeepSeek-V3 / R1 built from pdlab's ops: MLA in the absorbed form for both phases (paged latent
cache written with `store_kv`, read by `mla_prefill` / `mla_decode`), YaRN RoPE, RMSNorm, dense MLP
for the first `first_k_dense_replace` layers and `MoELayer` (with shared experts) for the rest.

Module and parameter names mirror the HF checkpoint (`model.layers.{i}.self_attn.q_a_proj.weight`,
...), except gate|up pairs, merged into `gate_up_proj`, and routed experts, which live in an
`ExpertWeights` handed to `MoEBlock.set_experts` (see loader.py)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from pdlab.runtime.context import ForwardContext
from pdlab.runtime.model.config import ModelConfig
from pdlab.runtime.model.layers import (ColumnParallelLinear, DenseMLP, ReplicatedLinear, RMSNorm,
                                        RotaryEmbedding, RowParallelLinear)

# DeepSeek's q_a/kv_a layernorms use the RMSNorm default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """Multi-head latent attention, absorbed: per token one latent row [c_kv (512) | k_pe (64)] is
    cached; queries become [q_nope·W_UK (512) | q_pe (64)]; the attention output per head (512,
    in latent space) is mapped by W_UV to v_head_dim, then o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_backend: str | None = None,
                 attn_config: dict | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale
        self.attn_backend, self.attn_config = attn_backend, attn_config
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, H * cfg.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, H * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(H * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        # Absorbed factors of kv_b_proj, derived by `post_load` (not checkpoint tensors).
        self.register_buffer("w_uk", torch.empty(0), persistent=False)  # [H, nope, 512]
        self.register_buffer("w_uv", torch.empty(0), persistent=False)  # [H, 512, v]

    def post_load(self) -> None:
        """Split kv_b_proj [H·(nope+v), 512] into W_UK [H, nope, 512] and W_UV [H, 512, v]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope, :].contiguous()
        self.w_uv = w[:, self.nope:, :].transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]; writes this step's T latent rows into the layer's pool."""
        from pdlab.attention import mla_decode, mla_prefill, store_kv

        T, H = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rotary.rotate(q_pe, cos, sin)
        k_pe = rotary.rotate(k_pe, cos, sin)

        kv_cache = ctx.kv_caches[self.layer_idx]
        op_dtype = x.dtype if kv_cache.dtype == torch.uint8 else kv_cache.dtype
        latent = torch.cat((c_kv, k_pe), dim=-1).to(op_dtype)  # [T, 576]
        store_kv(kv_cache, ctx.slots, latent, kv_scale=ctx.kv_scale)

        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, 512]
        q_abs = torch.cat((q_latent, q_pe), dim=-1).to(op_dtype)  # [T, H, 576]
        if ctx.is_decode:
            B = ctx.seqlens.shape[0]
            if T != B * ctx.q_len:
                raise ValueError(f"decode step has {T} tokens but {B} sequences × q_len {ctx.q_len}: "
                                 "decode batches must add exactly q_len tokens per sequence")
            out, _ = mla_decode(q_abs.view(B, ctx.q_len, H, -1), kv_cache, ctx.block_table, ctx.seqlens,
                                self.softmax_scale, kv_scale=ctx.kv_scale, backend=self.attn_backend,
                                config=self.attn_config)
            out = out.reshape(T, H, -1)
        else:
            out, _ = mla_prefill(q_abs, kv_cache, ctx.block_table, ctx.seqlens, ctx.qo_indptr,
                                 self.softmax_scale, kv_scale=ctx.kv_scale, max_q_len=ctx.max_q_len,
                                 backend=self.attn_backend, config=self.attn_config)
        out = out.to(x.dtype)
        v = torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)  # [T, H, v]
        return self.o_proj(v.reshape(T, H * self.v_dim))


class Router(nn.Module):
    """The MoE gate's parameters (checkpoint names `gate.weight` [E, H], `gate.e_score_correction_bias`
    [E]); both fp32, as DeepSeek-V3 keeps them. Routing itself runs inside `MoELayer`."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class MoEBlock(nn.Module):
    """Routed experts + shared experts of one layer, through `pdlab.moe.layer.MoELayer`.

    The gate and the shared experts are ordinary parameters (filled by the loader); the routed
    experts arrive as one `ExpertWeights` through `set_experts`, which builds the MoELayer. The
    MoELayer is kept outside the module tree (it references the gate / shared experts here), so
    `state_dict()` keys stay checkpoint names; build the model on its final device."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        from pdlab.moe.config import MoEConfig

        self.layer_idx = layer_idx
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size)
        self.shared_experts = (DenseMLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size)
                               if cfg.n_shared_experts > 0 else None)
        self.moe_config = MoEConfig(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                                    hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
                                    n_group=cfg.n_group, topk_group=cfg.topk_group,
                                    routed_scaling_factor=cfg.routed_scaling_factor,
                                    norm_topk_prob=cfg.norm_topk_prob, n_shared_experts=cfg.n_shared_experts)
        self.decode_mode = "normal"
        object.__setattr__(self, "moe", None)

    def set_experts(self, weights, *, runner: str | None = None, dispatcher: str = "local",
                    decode_mode: str = "normal", ep_size: int = 1, ep_rank: int = 0, group=None,
                    weights_layout: str | None = None, **moe_kwargs) -> None:
        """Build the MoELayer over `weights` (pdlab.moe.weights.ExpertWeights, [E, 2I, H] / [E, H, I]).
        Prefill/extend steps dispatch in "normal" mode, decode steps in `decode_mode`; `moe_kwargs`
        go to MoELayer as they are. weights_layout: how the layer's NVFP4 experts are stored, converted in place
        (one copy of the experts): "fragment" (the Triton runner's Gluon GEMMs, sm90), "tiled" (its in-loop
        kernel), "modelopt" (as loaded). None = when the weights are on CUDA, H and I are multiples of 128 and every
        mode runs "triton": "fragment" where those GEMMs run on this GPU, else "tiled"; otherwise as loaded."""
        from pdlab.moe.layer import MoELayer

        self.decode_mode = decode_mode
        modes = ("normal",) if decode_mode == "normal" else ("normal", decode_mode)
        object.__setattr__(self, "moe", MoELayer(
            self.moe_config, weights, self.gate.weight, self.gate.e_score_correction_bias, self.shared_experts,
            dispatcher=dispatcher, runner=runner, mode="normal", modes=modes, ep_rank=ep_rank, ep_size=ep_size,
            group=group, **moe_kwargs))
        from pdlab.moe.triton.nvfp4_frag import available
        from pdlab.moe.weights import NVFP4_LAYOUTS

        w = self.moe.weights
        if weights_layout is None:
            weights_layout = "modelopt"
            if w.can_tile and w.device.type == "cuda" and set(self.moe.runners.values()) == {"triton"}:
                weights_layout = "fragment" if available(w.device) is None else "tiled"
        if weights_layout not in NVFP4_LAYOUTS:
            raise ValueError(f"weights_layout {weights_layout!r}: use 'fragment', 'tiled', 'modelopt' or None (auto)")
        why = available(w.device) if weights_layout == "fragment" and w.device.type == "cuda" else None
        if why is not None:  # (on CPU the layout is kept for tests: the runner reads a modelopt copy)
            raise ValueError(f"--moe-weights-layout fragment: the triton runner's fragment-order GEMMs do not run "
                             f"on {torch.cuda.get_device_name(w.device)} ({why}); use --moe-weights-layout tiled "
                             f"or auto")
        if weights_layout != "modelopt" and not w.can_tile:
            what = ("its experts are not NVFP4 (bf16 checkpoint)" if not w.has_nvfp4 else
                    f"hidden {w.hidden_size} and moe_intermediate {w.intermediate_size} are not both multiples of 128")
            raise ValueError(f"--moe-weights-layout {weights_layout}: stores NVFP4 experts in the triton runner's "
                             f"128-wide tiles, and this model's cannot be: {what}; use --moe-weights-layout auto")
        w.store_(weights_layout)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] in the model dtype → the routed experts' output [T, hidden], same dtype (decode steps in the
        layer's decode dispatch mode, prefill in normal mode)."""
        if self.moe is None:
            raise RuntimeError(f"layer {self.layer_idx}: routed expert weights were never set; load the model "
                               "with pdlab.runtime.model.load_model (or call MoEBlock.set_experts)")
        return self.moe.forward(x, mode=self.decode_mode if ctx.is_decode else "normal")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_backend: str | None, attn_config: dict | None):
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_idx, attn_backend, attn_config)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoEBlock(cfg, layer_idx) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, rotary, ctx, stage=None):
        with stage("attention") if stage else contextlib.nullcontext():
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, rotary, ctx)
        with stage("moe" if self.is_moe else "dense_mlp") if stage else contextlib.nullcontext():
            x = self.post_attention_layernorm(h)
            return h + (self.mlp(x, ctx) if self.is_moe else self.mlp(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: str | None = None, attn_config: dict | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_backend, attn_config)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3/R1 causal LM over pdlab's ops (tensor-parallel size 1).

    Build with `load_model` (weights + post-load derivations); constructing it directly gives
    uninitialised weights and no routed experts.
    attn_backend / attn_config: passed to every `mla_prefill` / `mla_decode` call (None = registry's
    choice and tuned/default config).
    stage_hook: None, or a callable name → context manager wrapped around each stage of forward
    ("embed", per layer "attention" and "dense_mlp" / "moe", then "head"), e.g. CUDA-event timers
    (profile.py). Leave None when capturing CUDA graphs."""

    def __init__(self, config: ModelConfig, *, attn_backend: str | None = None, attn_config: dict | None = None):
        super().__init__()
        config.check_ops_shape()
        self.config = config
        self.model = DeepseekV3Model(config, attn_backend, attn_config)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size)
        self.stage_hook: Callable[[str], ContextManager] | None = None

    def post_load(self) -> None:
        """Derive W_UK / W_UV from kv_b_proj (call after weights change; the loader does)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.post_load()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One step over T new tokens of B sequences.

        Args:
            input_ids: [T] int64, the new tokens, grouped by sequence in ctx.qo_indptr order.
            positions: [T] int64, each token's position in its sequence (0-based).
            ctx: the step's ForwardContext (kv_caches: one pool per layer; slots [T]; is_decode, ...).
        Returns: logits [B, vocab] fp32 for the rows ctx.logits_indices [B] of the T tokens.
        Side effect: writes the T latent rows of every layer into ctx.kv_caches at ctx.slots.
        """
        T = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T] (1-D, same length); got "
                             f"{list(input_ids.shape)} and {list(positions.shape)}")
        if len(ctx.kv_caches) != self.config.num_hidden_layers:
            raise ValueError(f"ctx.kv_caches has {len(ctx.kv_caches)} pools but the model has "
                             f"{self.config.num_hidden_layers} layers: allocate one pool per layer")
        if ctx.slots.shape[0] != T:
            raise ValueError(f"ctx.slots has {ctx.slots.shape[0]} entries for {T} tokens: one slot per new token")
        m, stage = self.model, self.stage_hook
        with stage("embed") if stage else contextlib.nullcontext():
            h = m.embed_tokens(input_ids)
            cos, sin = m.rotary_emb(positions, h.dtype)
        for layer in m.layers:
            h = layer(h, cos, sin, m.rotary_emb, ctx, stage)
        with stage("head") if stage else contextlib.nullcontext():
            h = m.norm(h[ctx.logits_indices])
            return self.lm_head(h).float()
