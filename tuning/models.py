"""Model shapes the tuner builds its buckets at: DeepSeek-R1 by default, or any HF config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a DeepSeek-style model that set kernel shapes."""

    name: str
    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int

    @property
    def latent_dim(self) -> int:
        """Width of one MLA cache row (c_kv ‖ k_pe), 576 for DeepSeek-V3/R1."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def as_dict(self) -> dict:
        return asdict(self)


DEEPSEEK_R1 = ModelShape("deepseek-r1", hidden_size=7168, num_heads=128, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, moe_intermediate_size=2048,
                         n_routed_experts=256, num_experts_per_tok=8)

NAMED = {"deepseek-r1": DEEPSEEK_R1, "deepseek-v3": DEEPSEEK_R1}

# what `tune --arch cpu` runs for a named model (the shapes of `bench moe` on a CPU machine, MLA's cache row kept):
# R1's experts alone take minutes to quantise on a CPU, before the first trial
CPU_SMALL = ModelShape("deepseek-r1-cpu-small", hidden_size=256, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                       qk_nope_head_dim=128, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4)


def cpu_shape(name_or_path: str | None, model: ModelShape) -> ModelShape:
    """The shape a CPU target tunes at: `CPU_SMALL` for a named model (or none), a config file's as it is."""
    return CPU_SMALL if not name_or_path or name_or_path.lower() in NAMED else model


def load_model_shape(name_or_path: str | None) -> ModelShape:
    """A named model ("deepseek-r1", "deepseek-v3") or an HF config.json (file or its folder)."""
    if not name_or_path:
        return DEEPSEEK_R1
    if name_or_path.lower() in NAMED:
        return NAMED[name_or_path.lower()]
    path = Path(name_or_path).expanduser().resolve()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {name_or_path!r}: not a known model ({', '.join(NAMED)}) and no "
                         "config.json there; pass a name or an HF config.json path")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {path}: not JSON ({exc}); pass an HF config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {path}: holds a JSON {type(cfg).__name__}, not a JSON object; pass an HF "
                         "config.json")
    need = ["hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"--model {path}: missing {', '.join(missing)}; tuning needs a DeepSeek-V3-style config "
                         "(MLA + routed experts)")
    bad = [k for k in need if isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] < 1]
    if bad:
        raise ValueError(f"--model {path}: {', '.join(f'{k}={cfg[k]!r}' for k in bad)}: each must be an integer "
                         ">= 1")
    if cfg["num_experts_per_tok"] > cfg["n_routed_experts"]:
        raise ValueError(f"--model {path}: num_experts_per_tok={cfg['num_experts_per_tok']} routes each token to more "
                         f"experts than n_routed_experts={cfg['n_routed_experts']}; pass a config whose top-k is at "
                         "most its expert count")
    name = cfg.get("_name_or_path") or (path.parent.name if path.name == "config.json" else path.stem)
    return ModelShape(name, cfg["hidden_size"],
                      cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
                      cfg["qk_nope_head_dim"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
                      cfg["num_experts_per_tok"])
