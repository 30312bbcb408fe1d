"""`runtime`: serve a model with pdlab's kernels (colocated, or prefill/decode disaggregated)."""

from __future__ import annotations

import importlib
import sys

from pdlab._subcommands import Subcommand, run_tool

SUBCOMMANDS = {
    "serve": Subcommand("pdlab.runtime.server.serve", "start a server: colocated, one role, or --disagg"),
    "doctor": Subcommand("pdlab.bench.doctor", "which backend of which op runs on this machine, and why not"),
}

DISAGG_LAUNCHER = "pdlab.runtime.disagg.launch"


def main(argv: list[str] | None = None, prog: str = "runtime") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve" and _wants_disagg(argv[1:]):
        try:
            launcher = importlib.import_module(DISAGG_LAUNCHER)
        except ModuleNotFoundError as exc:
            if exc.name not in (DISAGG_LAUNCHER, "pdlab.runtime.disagg"):
                raise
            print(f"{prog} serve --disagg/--role: not built yet", file=sys.stderr)
            return 2
        return int(launcher.main(argv[1:]) or 0)
    return run_tool(prog, __doc__.split(":", 1)[1].strip(), SUBCOMMANDS, argv)


def _wants_disagg(args: list[str]) -> bool:
    """`serve --disagg` or `serve --role ...` go to the disaggregation launcher."""
    return any(a == "--disagg" or a == "--role" or a.startswith("--role=") for a in args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
