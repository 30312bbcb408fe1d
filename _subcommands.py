"""Shared plumbing of the `bench`, `tune` and `runtime` tools: a table of subcommands, each one a
module with `add_arguments(parser)` and `run(args) -> int`, imported only when it is chosen."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str  # e.g. "pdlab.bench.attention"
    help: str


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose "unrecognized arguments" error names the flag each unknown one likely meant."""

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            flags = [f for f in self._option_string_actions if f.startswith("--")]
            hints = []
            for arg in extra:
                name = arg.split("=", 1)[0]
                near = difflib.get_close_matches(name, flags, n=1, cutoff=0.75) if name.startswith("--") else []
                if near:
                    hints.append(f"{name}: did you mean {near[0]}?")
            self.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))
        return parsed


def arg_parser(**kwargs) -> argparse.ArgumentParser:
    """Every pdlab command's parser: an `argparse.ArgumentParser(**kwargs)` that takes flags only as spelt out in full
    (allow_abbrev off: `--decode URL` is not read as `--decode-reserve-tokens URL`), and whose error for an unknown
    flag names the flag it likely meant (`--max-running-request`: did you mean --max-running-requests?)."""
    return _Parser(allow_abbrev=False, **kwargs)


def run_tool(prog: str, description: str, table: dict[str, Subcommand], argv: list[str] | None) -> int:
    """Parse `argv` for one tool and run the chosen subcommand; returns the process exit code.

    A subcommand whose module does not exist yet prints one line saying so and returns 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} {{{','.join(table)}}} ...\n\n{description}\n\nsubcommands:")
        for name, sub in table.items():
            print(f"  {name:<12} {sub.help}")
        print(f"\n`{prog} SUBCOMMAND --help` shows a subcommand's options.")
        return 0 if argv else 2
    name = argv[0]
    if name not in table:
        print(f"{prog}: unknown subcommand {name!r}; choose one of {', '.join(table)}", file=sys.stderr)
        return 2
    sub = table[name]
    try:
        module = importlib.import_module(sub.module)
    except ModuleNotFoundError as exc:
        if exc.name != sub.module:
            raise
        print(f"{prog} {name}: not built yet in this version of pdlab", file=sys.stderr)
        return 2
    parser = arg_parser(prog=f"{prog} {name}", description=sub.help)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


def comma_list(item, what: str):
    """An argparse `type` for a comma-separated option: every item must pass `item(text)` (which raises
    ValueError with the reason). Returns the text unchanged, so the command splits it as before; a bad item
    becomes argparse's usage error (exit 2) naming the item, why, and `what` is expected."""

    def parse(text: str) -> str:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list; expected {what}")
        for t in items:
            try:
                item(t)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{t!r} {exc}; expected {what}") from None
        return text

    return parse


def list_items(text: str | None, item=str) -> list:
    """The items of a comma-separated option as `comma_list` checks them: stripped, blanks dropped, each through
    `item`, a value named twice kept once (in first order). None or empty text: []."""
    return list(dict.fromkeys(item(t.strip()) for t in (text or "").split(",") if t.strip()))


def at_least(minimum: int):
    """An item check accepting integers >= minimum (ValueError with the reason otherwise)."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
        if value < minimum:
            raise ValueError(f"is below {minimum}")
        return value

    return check


positive_int = at_least(1)


def one_of(*choices: str):
    """An item check accepting exactly `choices`."""

    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return text

    return check


def int_arg(minimum: int = 1, what: str | None = None):
    """An argparse `type` for one integer >= minimum (the usage error says why and what is expected)."""
    check = at_least(minimum)

    def parse(text: str) -> int:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc}; expected {what or f'an integer >= {minimum}'}") from None

    return parse
