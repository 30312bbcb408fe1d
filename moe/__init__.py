"""NVFP4 MoE for DeepSeek-style models: routing, dispatch layouts, expert weights and runners.

`layouts` holds the two dispatch-output layouts (Contiguous, Masked) and the single-rank grouping
helpers; `routing.route`, `weights.ExpertWeights` and `experts.run_experts` build on them.
"""

from pdlab.moe.layouts import (LAYOUTS, PAYLOADS, Contiguous, GroupInfo, Masked, dequantize_hidden,
                               group_tokens, layout_op, quantize_payload, to_contiguous, to_masked,
                               with_hidden)

__all__ = ["LAYOUTS", "PAYLOADS", "Contiguous", "GroupInfo", "Masked", "dequantize_hidden", "group_tokens",
           "layout_op", "quantize_payload", "to_contiguous", "to_masked", "with_hidden",
           "route", "ExpertWeights", "run_experts", "check_pairing"]

_LAZY = {"route": "pdlab.moe.routing", "ExpertWeights": "pdlab.moe.weights", "run_experts": "pdlab.moe.experts",
         "check_pairing": "pdlab.moe.experts"}


def __getattr__(name: str):
    # the ops load on first use, so that importing the layouts stays light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdlab.moe' has no attribute {name!r}")
