"""`tune`: search kernel configurations with optuna and store the winners per device and shape."""

from __future__ import annotations

from pdlab._subcommands import Subcommand, run_tool

SUBCOMMANDS = {
    "attention": Subcommand("pdlab.tuning.attention", "tune the MLA attention backends (mla_decode, mla_prefill)"),
    "moe": Subcommand("pdlab.tuning.moe", "tune the MoE expert runners"),
    "dispatch": Subcommand("pdlab.tuning.dispatch", "tune the token dispatchers"),
    "show": Subcommand("pdlab.tuning.show", "print the tuned configs this machine would use"),
}


def main(argv: list[str] | None = None, prog: str = "tune") -> int:
    return run_tool(prog, __doc__.split(":", 1)[1].strip(), SUBCOMMANDS, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
