"""`bench`: measure pdlab's kernels (and servers) at real shapes against the roofline and each other."""

from __future__ import annotations

from pdlab._subcommands import Subcommand, run_tool

SUBCOMMANDS = {
    "list": Subcommand("pdlab.bench.doctor", "which backend of which op runs on this machine, and why not"),
    "quantize": Subcommand("pdlab.bench.quantize", "NVFP4 quantization kernels (bf16 -> packed e2m1 + e4m3 scales)"),
    "contracts": Subcommand("pdlab.bench.contracts", "overhead of the shape-checked op contracts per call"),
    "attention": Subcommand("pdlab.bench.attention", "MLA decode/prefill backends at DeepSeek shapes"),
    "moe": Subcommand("pdlab.bench.moe", "MoE layer stages: route, quantize, dispatch, experts, combine"),
    "serving": Subcommand("pdlab.bench.serving", "load generator against an OpenAI-compatible server"),
}


def main(argv: list[str] | None = None, prog: str = "bench") -> int:
    return run_tool(prog, __doc__.split(":", 1)[1].strip(), SUBCOMMANDS, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
