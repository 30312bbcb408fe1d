"""`runtime`: serve a model with pdlab's kernels (colocated, or prefill/decode disaggregated)."""

from __future__ import annotations

from pdlab._subcommands import Subcommand, run_tool

SUBCOMMANDS = {
    "serve": Subcommand("pdlab.runtime.server.serve", "start a server: colocated, one role, or --disagg"),
    "doctor": Subcommand("pdlab.bench.doctor", "which backend of which op runs on this machine, and why not"),
}


def main(argv: list[str] | None = None, prog: str = "runtime") -> int:
    return run_tool(prog, __doc__.split(":", 1)[1].strip(), SUBCOMMANDS, argv)
