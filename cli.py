"""`pdlab bench|tune|runtime ...`: one entry point with the three tools as subcommands."""

from __future__ import annotations

import sys

_TOOLS = {
    "bench": ("pdlab.bench.cli", "measure kernels and servers against the roofline and each other"),
    "tune": ("pdlab.tuning.cli", "search kernel configurations with optuna and store the winners"),
    "runtime": ("pdlab.runtime.cli", "serve a model (colocated or prefill/decode disaggregated)"),
}


def _usage() -> str:
    lines = ["usage: pdlab {bench,tune,runtime} ...", "", "tools:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in _TOOLS.items()]
    lines += ["", "`pdlab TOOL --help` shows each tool's subcommands."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from pdlab import __version__

        print(f"pdlab {__version__}")
        return 0
    tool = argv[0]
    if tool not in _TOOLS:
        print(f"pdlab: unknown tool {tool!r}; choose one of {', '.join(_TOOLS)}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_TOOLS[tool][0])
    return module.main(argv[1:], prog=f"pdlab {tool}")
