"""NVFP4 MoE for DeepSeek-style models: routing, dispatch layouts, expert weights and runners.

`layouts` holds the two dispatch-output layouts (Contiguous, Masked) and the single-rank grouping
helpers; `routing.route`, `weights.ExpertWeights` and `experts.run_experts` build on them.
"""

from pdlab.moe.layouts import (LAYOUTS, PAYLOADS, Contiguous, GroupInfo, Masked, dequantize_hidden,
                               group_tokens, layout_op, quantize_payload, to_contiguous, to_masked,
                               with_hidden)

__all__ = ["LAYOUTS", "PAYLOADS", "Contiguous", "GroupInfo", "Masked", "dequantize_hidden", "group_tokens",
           "layout_op", "quantize_payload", "to_contiguous", "to_masked", "with_hidden"]
