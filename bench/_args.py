"""argparse `type`s the bench commands share (light: no torch or pandas at parse time)."""

from __future__ import annotations

import argparse
import os


def seconds(text: str) -> float:
    """A number of seconds > 0 (the usage error names what was given)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def file_stem(text: str) -> str:
    """A result file stem: a name, not a path (the folder is --out)."""
    if not text or text in (".", "..") or "/" in text or os.sep in text:
        raise argparse.ArgumentTypeError(f"{text!r} is a file stem, without folders (put the folder in --out)")
    return text


def nvfp4_size(text: str) -> int:
    """A hidden or intermediate size NVFP4 can quantize: a multiple of its 16-element blocks."""
    from pdlab._subcommands import int_arg

    value = int_arg(16, "a multiple of 16, e.g. 2048 or 7168")(text)
    if value % 16:
        raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of 16 (NVFP4 quantizes blocks of 16); "
                                         "expected e.g. 2048 or 7168")
    return value


def json_object(text: str) -> str:
    """A JSON object, e.g. a kernel config '{"BLOCK_N": 64}' (returned as the text)."""
    import json

    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; expected e.g. '{{\"BLOCK_N\": 64}}'")
    return text


def add_no_plot(p: argparse.ArgumentParser) -> None:
    """--no-plot, the same for every bench and tune command that draws PNG plots."""
    p.add_argument("--no-plot", action="store_true",
                   help="write no PNG plots (the CSV and JSON results are written as always)")


def out_dir_problem(path: str | os.PathLike) -> str | None:
    """Why the results folder `path` cannot take a command's files (it is made here when missing), else None."""
    from pathlib import Path

    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} is not a folder (a file of that name exists)"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{p} is not a folder that can be made ({exc.strerror or exc})"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not a folder this user can write"
    return None
