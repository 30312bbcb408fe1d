"""`runtime`: serve a model with pdlab's kernels (colocated, or prefill/decode disaggregated)."""

from __future__ import annotations

import importlib
import sys

from pdlab._subcommands import Subcommand, arg_parser, run_tool

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
    if argv and argv[0] == "serve":
        problem = _disagg_only_flag(argv[1:])
        if problem:
            print(f"{prog} serve: error: {problem}", file=sys.stderr)
            return 2
    return run_tool(prog, __doc__.split(":", 1)[1].strip(), SUBCOMMANDS, argv)


def _disagg_only_flag(args: list[str]) -> str | None:
    """Why `serve` without --disagg/--role cannot take one of `args`: a flag only the disaggregation launcher reads
    (--decode URL, --policy, a transfer setting) was given to a colocated server; None when there is none."""
    try:
        from pdlab.runtime.disagg import launch
        from pdlab.runtime.server import serve
    except ModuleNotFoundError:  # a build without the launcher: serve's own parser reports the flag
        return None
    flags = []
    for module in (launch, serve):
        p = arg_parser(add_help=False)
        module.add_arguments(p)
        flags.append(set(p._option_string_actions))
    router = {"--" + f.replace("_", "-") for f in launch.ROUTER_FLAGS}
    for arg in args:
        name = arg.split("=", 1)[0]
        if name not in flags[0] - flags[1]:
            continue
        if name == "--start-timeout":
            return f"{name} is how long --disagg waits for its servers to start: add --disagg"
        if name in router:
            return (f"{name} is a router setting: start the router with `runtime serve --role router --decode URL "
                    "[URL ...] [--prefill URL ...]`, or use --disagg to start prefill and decode servers and a "
                    "router on this machine")
        return (f"{name} is a setting of a disaggregated server: add --role prefill or --role decode, or use "
                "--disagg to start both and a router on this machine")
    return None


def _wants_disagg(args: list[str]) -> bool:
    """`serve --disagg` or `serve --role ...` go to the disaggregation launcher."""
    return any(a == "--disagg" or a == "--role" or a.startswith("--role=") for a in args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
