"""MoEConfig: the shape of one DeepSeek-style MoE layer (routed experts, routing groups, scaling)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape.

    num_experts: routed experts E. top_k: experts per token. hidden_size: H (model width).
    intermediate_size: I (per routed expert; gate_up is [2I, H], down [H, I]).
    n_group / topk_group: DeepSeek group-limited routing (experts split into n_group groups, the
    top topk_group groups kept). routed_scaling_factor: multiplies the routed weights.
    norm_topk_prob: renormalise the top-k weights to sum to 1 (before the scaling factor).
    scoring_func / topk_method: the HF config's routing, one of ROUTING_METHODS: DeepSeek-V3's "sigmoid" +
    "noaux_tc" (the default), DeepSeek-V2's "softmax" + "greedy" or "group_limited_greedy".
    n_shared_experts / shared_intermediate_size: the shared expert(s) beside the routed ones
    (informational: the layer takes the shared expert as a module).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_shared_experts: int = 0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"

    def __post_init__(self) -> None:
        problems = []
        routing = routing_problem(self.scoring_func, self.topk_method, self.routed_scaling_factor,
                                  self.norm_topk_prob)
        if routing:
            problems.append(routing)
        if self.num_experts <= 0 or self.top_k <= 0 or self.top_k > self.num_experts:
            problems.append(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_group <= 0 or self.num_experts % self.n_group:
            problems.append(f"num_experts={self.num_experts} must be divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= max(self.n_group, 1):
            problems.append(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        elif self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            problems.append(f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts "
                            f"hold fewer than top_k={self.top_k} experts")
        if self.hidden_size <= 0 or self.intermediate_size <= 0:
            problems.append("hidden_size and intermediate_size must be positive")
        if problems:
            raise ValueError("MoEConfig: " + "; ".join(problems))

    @property
    def flops_per_token_expert(self) -> int:
        """FLOPs of one (token, expert) pair: gate_up (2·H·2I) + down (2·I·H)."""
        return 6 * self.hidden_size * self.intermediate_size

    def local(self, ep_size: int) -> int:
        """Experts per rank under expert parallelism of `ep_size` ranks (ValueError if uneven)."""
        if ep_size <= 0 or self.num_experts % ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={ep_size}; "
                             f"choose an EP size that divides it")
        return self.num_experts // ep_size

    def scaled(self, **changes: Any) -> "MoEConfig":
        return replace(self, **changes)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike) -> "MoEConfig":
        """From an HF DeepseekV3 / DeepseekV2 config (a dict, or a path to config.json / its folder). Routing fields
        the config leaves out take the defaults of transformers' class for its model_type: DeepseekV2 routes by
        softmax + greedy without renormalising, DeepseekV3 by sigmoid + noaux_tc with it."""
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        missing = [k for k in ("n_routed_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")
                   if k not in config]
        if missing:
            raise ValueError(f"config has no {', '.join(missing)}: not a DeepseekV3-style MoE config "
                             f"(model_type={config.get('model_type')!r})")
        v2 = config.get("model_type") == "deepseek_v2"

        def get(key: str, default: Any) -> Any:
            return default if config.get(key) is None else config[key]

        return cls(num_experts=int(config["n_routed_experts"]), top_k=int(config["num_experts_per_tok"]),
                   hidden_size=int(config["hidden_size"]), intermediate_size=int(config["moe_intermediate_size"]),
                   n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                   routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
                   norm_topk_prob=bool(get("norm_topk_prob", not v2)),
                   n_shared_experts=int(config.get("n_shared_experts") or 0),
                   scoring_func=get("scoring_func", "softmax" if v2 else "sigmoid"),
                   topk_method=get("topk_method", "greedy" if v2 else "noaux_tc"))


# (scoring_func, topk_method) pairs the router runs: DeepSeek-V3's, then DeepSeek-V2's (V2-Lite: greedy)
ROUTING_METHODS = (("sigmoid", "noaux_tc"), ("softmax", "greedy"), ("softmax", "group_limited_greedy"))


def routing_problem(scoring_func: str, topk_method: str, routed_scaling_factor: float, norm_topk_prob: bool
                    ) -> str | None:
    """Why the router cannot run this routing (naming the config field and its value), or None."""
    if not (isinstance(routed_scaling_factor, (int, float)) and 0 < routed_scaling_factor < math.inf):
        return scaling_problem(routed_scaling_factor)
    scorings = sorted({s for s, _ in ROUTING_METHODS})
    methods = [m for _, m in ROUTING_METHODS]
    if scoring_func not in scorings:
        return f"scoring_func={scoring_func!r} is not supported (choose one of {', '.join(map(repr, scorings))})"
    if topk_method not in methods:
        return f"topk_method={topk_method!r} is not supported (choose one of {', '.join(map(repr, methods))})"
    if (scoring_func, topk_method) not in ROUTING_METHODS:
        pairs = ", ".join(f"{s}+{m}" for s, m in ROUTING_METHODS)
        return (f"topk_method={topk_method!r} with scoring_func={scoring_func!r} is not supported (supported "
                f"scoring_func+topk_method: {pairs})")
    if scoring_func == "softmax" and norm_topk_prob and routed_scaling_factor != 1.0:
        # DeepSeek's V2 code scales only weights it did not renormalise; transformers' DeepseekV2 never
        # renormalises; other engines renormalise, then scale: the three disagree, so none is guessed
        return (f"norm_topk_prob=True with routed_scaling_factor={routed_scaling_factor:g} and scoring_func="
                f"'softmax' is not supported: DeepSeek-V2 implementations disagree on whether the renormalised "
                f"weights are scaled (set norm_topk_prob false, as DeepSeek-V2 configs do, or the factor to 1)")
    return None


def scaling_problem(routed_scaling_factor: Any) -> str:
    return (f"routed_scaling_factor={routed_scaling_factor!r} must be a finite number > 0 (it multiplies every "
            "routed weight: 1.0 leaves them as they are, DeepSeek-V3 uses 2.5)")


DEEPSEEK_R1 = MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)

PRESETS = {"deepseek-r1": DEEPSEEK_R1, "deepseek-v3": DEEPSEEK_R1}


def resolve_model(name_or_path: str) -> MoEConfig:
    """A preset name (deepseek-r1, deepseek-v3) or a path to an HF config.json / model folder."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        return MoEConfig.from_hf(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)} or a path to an HF "
                     "DeepseekV3 or DeepseekV2 config.json")
