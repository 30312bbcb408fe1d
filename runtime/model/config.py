"""`ModelConfig`: the HF `config.json` of a DeepSeek-V3 / R1 checkpoint, normalised once into typed
fields. Layers read only this object, never raw HF attributes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# pdlab's MLA ops work on one latent row of 576 values: c_kv (512) | k_pe (64).
OPS_KV_LORA_RANK = 512
OPS_ROPE_HEAD_DIM = 64


class ConfigError(ValueError):
    """A checkpoint config pdlab cannot serve; the message names the field, its value and the fix."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the 64-dim `pe` part (transformers' DeepseekV3 semantics).

    kind: "default" or "yarn". For yarn: `factor`, `original_max_position_embeddings`,
    `beta_fast`/`beta_slow` (correction range, floor/ceil-truncated when `truncate`), `mscale` and
    `mscale_all_dim`; `attention_factor` scales cos/sin, `softmax_mscale` multiplies the softmax
    scale (squared there). `interleave`: the pe dims are stored in (even, odd) pairs (DeepSeek's
    layout, transformers' `rope_interleave=True`)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True
    interleave: bool = True

    @property
    def attention_factor(self) -> float:
        """Multiplier of cos/sin (1 for default rope)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return float(yarn_mscale(self.factor))

    @property
    def softmax_mscale(self) -> float:
        """YaRN's mscale applied (squared) to the softmax scale; 1 when mscale_all_dim is unset."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1·mscale·ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class QuantConfig:
    """Checkpoint quantization (modelopt `hf_quant_config.json`). Only NVFP4 is supported."""

    algo: str = "NVFP4"
    group_size: int = 16
    exclude_modules: tuple[str, ...] = ()
    kv_cache_algo: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3/R1 model's shape and hyper-parameters (all normalised, typed)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    architecture: str = "DeepseekV3ForCausalLM"
    quant: QuantConfig | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived values (never stored twice)
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token in the MLA KV cache (c_kv | k_pe); 576 for DeepSeek-V3."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_nope + qk_rope) × YaRN mscale² (the scale of the un-absorbed attention, which
        the absorbed form keeps)."""
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale ** 2

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], quant: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Normalise a HF `config.json` dict (old `rope_scaling` or new `rope_parameters` style)
        and optionally a modelopt `hf_quant_config.json` dict. Raises ConfigError naming the field."""
        hf = dict(hf)
        archs = hf.get("architectures") or []
        if not isinstance(archs, (list, tuple)):
            raise ConfigError(f"config.json 'architectures' must be a list of class names, e.g. "
                              f"[\"DeepseekV3ForCausalLM\"], got {archs!r}")
        model_type = hf.get("model_type")
        arch = archs[0] if archs else None
        if arch is None and model_type == "deepseek_v3":
            arch = "DeepseekV3ForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {archs or model_type!r} (config.json 'architectures'); pdlab serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (DeepSeek-V3 and R1 checkpoints) only")

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ConfigError(f"config.json lacks '{key}', which a {arch} config must have")
            return hf[key]

        def integer(key: str, value: Any) -> int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config.json '{key}' must be an integer, got {value!r}")

        def number(key: str, value: Any) -> float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise ConfigError(f"config.json '{key}' must be a number, got {value!r}")

        def get(key: str, default: Any) -> Any:
            v = hf.get(key)
            return default if v is None else v

        qc = hf.get("quantization_config")
        if isinstance(qc, Mapping) and qc.get("quant_method") == "fp8":
            raise ConfigError("config.json's quantization_config is fp8 (DeepSeek's block-scaled FP8 release), which "
                              "pdlab does not load: convert it to bf16 first, or use a modelopt NVFP4 checkpoint")
        if get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (DeepSeek-V3 uses 'silu')")
        if get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {hf['moe_layer_freq']} is not supported (DeepSeek-V3 uses 1)")
        if get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"topk_method {hf['topk_method']!r} is not supported (DeepSeek-V3 uses 'noaux_tc')")
        if get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"scoring_func {hf['scoring_func']!r} is not supported (DeepSeek-V3 uses 'sigmoid')")
        heads = integer("num_attention_heads", need("num_attention_heads"))
        kv_heads = get("num_key_value_heads", heads)
        if kv_heads != heads:
            raise ConfigError(f"num_key_value_heads {kv_heads} != num_attention_heads {heads}; MLA has one "
                              "latent shared by all heads and DeepSeek-V3 configs set both equal")
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        eos_ids = tuple(integer("eos_token_id", e) for e in eos_list)
        bos = hf.get("bos_token_id")
        cfg = cls(
            vocab_size=integer("vocab_size", need("vocab_size")),
            hidden_size=integer("hidden_size", need("hidden_size")),
            intermediate_size=integer("intermediate_size", need("intermediate_size")),
            moe_intermediate_size=integer("moe_intermediate_size", need("moe_intermediate_size")),
            num_hidden_layers=integer("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=None if hf.get("q_lora_rank") is None else integer("q_lora_rank", hf["q_lora_rank"]),
            kv_lora_rank=integer("kv_lora_rank", need("kv_lora_rank")),
            qk_nope_head_dim=integer("qk_nope_head_dim", need("qk_nope_head_dim")),
            qk_rope_head_dim=integer("qk_rope_head_dim", need("qk_rope_head_dim")),
            v_head_dim=integer("v_head_dim", need("v_head_dim")),
            n_routed_experts=integer("n_routed_experts", get("n_routed_experts", 0)),
            n_shared_experts=integer("n_shared_experts", get("n_shared_experts", 0)),
            num_experts_per_tok=integer("num_experts_per_tok", get("num_experts_per_tok", 0)),
            n_group=integer("n_group", get("n_group", 1)),
            topk_group=integer("topk_group", get("topk_group", 1)),
            routed_scaling_factor=number("routed_scaling_factor", get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            first_k_dense_replace=integer("first_k_dense_replace", get("first_k_dense_replace", 0)),
            rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps", 1e-6)),
            max_position_embeddings=integer("max_position_embeddings", get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(hf),
            attention_bias=bool(get("attention_bias", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else integer("bos_token_id", bos),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=integer("num_nextn_predict_layers",
                                             get("num_nextn_predict_layers", get("num_mtp_layers", 0))),
            architecture=arch,
            quant=_quant_from_hf(quant) if quant else None,
            extra={k: v for k, v in hf.items() if k not in _KNOWN},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject impossible shapes with the reason (ConfigError)."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_position_embeddings <= 0:
            raise ConfigError(f"max_position_embeddings must be positive (the model's context; 163840 for "
                              f"DeepSeek-V3), got {self.max_position_embeddings}")
        if not self.rms_norm_eps >= 0:
            raise ConfigError(f"rms_norm_eps must be >= 0, got {self.rms_norm_eps}: a negative epsilon makes the "
                              "norms divide by the square root of a negative number (NaN logits)")
        for name in ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                     "first_k_dense_replace", "qk_nope_head_dim", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank must be positive, or null for a model without query compression, got "
                              f"{self.q_lora_rank}")
        bad_eos = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if bad_eos:
            raise ConfigError(f"eos_token_id {bad_eos[0]} is outside the vocabulary (0..{self.vocab_size - 1}): "
                              "generation could never stop on it; fix eos_token_id in config.json")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.n_routed_experts > 0 and self.first_k_dense_replace < self.num_hidden_layers:
            if self.num_experts_per_tok <= 0 or self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                                  f"1..n_routed_experts ({self.n_routed_experts})")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts {self.n_routed_experts} must split into n_group "
                                  f"{self.n_group} equal groups")
            if not 0 < self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
        if self.rope.kind not in ("default", "yarn"):
            raise ConfigError(f"rope type {self.rope.kind!r} is not supported (DeepSeek-V3 uses 'yarn' or none)")
        if self.quant is not None and self.quant.algo != "NVFP4":
            raise ConfigError(f"hf_quant_config quant_algo {self.quant.algo!r} is not supported; pdlab loads "
                              "bf16/fp32 checkpoints and modelopt NVFP4 ones")

    def check_ops_shape(self) -> None:
        """The MLA ops hold a 576-value latent (512 + 64): raise ConfigError for other ranks."""
        if self.kv_lora_rank != OPS_KV_LORA_RANK or self.qk_rope_head_dim != OPS_ROPE_HEAD_DIM:
            raise ConfigError(
                f"pdlab's MLA ops need kv_lora_rank {OPS_KV_LORA_RANK} and qk_rope_head_dim {OPS_ROPE_HEAD_DIM} "
                f"(one 576-value latent per token) but the config has kv_lora_rank {self.kv_lora_rank}, "
                f"qk_rope_head_dim {self.qk_rope_head_dim}: shrink other dims of a test config instead")

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config (for writing checkpoints, e.g. the tiny model)."""
        rope: dict[str, Any] = {"rope_theta": self.rope.theta}
        out = {
            "architectures": [self.architecture], "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_group": self.n_group,
            "topk_group": self.topk_group, "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob, "first_k_dense_replace": self.first_k_dense_replace,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "num_nextn_predict_layers": self.num_nextn_predict_layers, "hidden_act": "silu",
            "rope_theta": self.rope.theta, "rope_interleave": self.rope.interleave,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
        }
        if self.rope.kind == "yarn":
            rope = {"type": "yarn", "factor": self.rope.factor, "beta_fast": self.rope.beta_fast,
                    "beta_slow": self.rope.beta_slow,
                    "original_max_position_embeddings": self.rope.original_max_position_embeddings}
            if self.rope.mscale is not None:
                rope["mscale"] = self.rope.mscale
            if self.rope.mscale_all_dim is not None:
                rope["mscale_all_dim"] = self.rope.mscale_all_dim
            out["rope_scaling"] = rope
        return out


_KNOWN = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
    "first_k_dense_replace", "rms_norm_eps", "max_position_embeddings", "rope_scaling", "rope_parameters",
    "rope_theta", "rope_interleave", "attention_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "num_nextn_predict_layers", "num_mtp_layers", "hidden_act", "moe_layer_freq", "topk_method", "scoring_func",
    "quantization_config",
}


def _rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs and the
    # DeepSeek checkpoints write `rope_scaling` plus a top-level `rope_theta`.
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], Mapping):
            raise ConfigError(f"config.json '{key}' must be an object such as {{\"type\": \"yarn\", \"factor\": 40}} "
                              f"or null, got {hf[key]!r}")
    params = dict(hf.get("rope_parameters") or {})
    src = "rope_parameters" if params else "rope_scaling"
    if "rope_type" not in params and "type" not in params and hf.get("rope_scaling"):
        params.update(hf["rope_scaling"])

    def number(value: Any, where: str) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"config.json {where} must be a finite number, got {value!r}")

    theta_where = f"'{src}.rope_theta'" if "rope_theta" in params else "'rope_theta'"
    theta = number(params.get("rope_theta", hf.get("rope_theta", 10000.0)), theta_where)
    if theta <= 0:
        raise ConfigError(f"config.json {theta_where} must be positive (the rotary base, 10000 for DeepSeek-V3), "
                          f"got {theta:g}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    interleave = bool(hf.get("rope_interleave", True) if hf.get("rope_interleave") is not None else True)
    if kind == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} (config.json rope_scaling/rope_parameters) is not supported; "
                          "DeepSeek-V3 uses 'yarn' or no scaling")
    max_pos = int(hf.get("max_position_embeddings", 4096))

    def opt(key: str) -> float | None:
        return None if params.get(key) is None else number(params[key], f"'{src}.{key}'")

    orig = int(opt("original_max_position_embeddings") or max_pos)
    factor = opt("factor")
    factor = factor if factor is not None else max_pos / orig
    if factor <= 0 or orig <= 0:
        raise ConfigError(f"config.json '{src}': YaRN needs a positive factor and original_max_position_embeddings, "
                          f"got factor {factor:g}, original_max_position_embeddings {orig} (DeepSeek-V3: 40 and 4096)")
    return RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=orig,
                      beta_fast=opt("beta_fast") or 32.0, beta_slow=opt("beta_slow") or 1.0,
                      mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                      attention_factor_override=opt("attention_factor"),
                      truncate=bool(params.get("truncate", True)), interleave=interleave)


def _quant_from_hf(q: Mapping[str, Any]) -> QuantConfig:
    body = q.get("quantization", q)
    algo = body.get("quant_algo")
    if algo is None:
        raise ConfigError("hf_quant_config.json has no quantization.quant_algo")
    return QuantConfig(algo=str(algo), group_size=int(body.get("group_size", 16)),
                       exclude_modules=tuple(body.get("exclude_modules") or ()),
                       kv_cache_algo=body.get("kv_cache_quant_algo"))


def read_json_object(file: Path) -> dict:
    """A JSON file holding one object (config.json, hf_quant_config.json, tokenizer_config.json); ConfigError (a
    ValueError) naming the file otherwise."""
    try:
        data = json.loads(Path(file).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON ({exc}); fix it or download it again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} holds a JSON {type(data).__name__}, expected an object of settings; "
                          "download it again")
    return data
