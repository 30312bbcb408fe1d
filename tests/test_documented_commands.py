"""Every `pdlab bench|tune|runtime SUB --flag` written in the README, docs/ and the GPU scripts under bench/gpu/
names a subcommand and flags that exist: a renamed or removed flag fails here, not when someone copies the line."""

import importlib
import pathlib
import re

import pdlab
from pdlab._subcommands import arg_parser

ROOT = pathlib.Path(pdlab.__file__).parent
COMMAND = re.compile(r"pdlab (bench|tune|runtime) ([a-z_]+)([^\n|;&`)]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _tables():
    from pdlab.bench.cli import SUBCOMMANDS as bench
    from pdlab.runtime.cli import SUBCOMMANDS as runtime
    from pdlab.tuning.cli import SUBCOMMANDS as tune

    return {"bench": bench, "tune": tune, "runtime": runtime}


def _flags(tables, tool: str, sub: str) -> set[str]:
    parser = arg_parser()
    importlib.import_module(tables[tool][sub].module).add_arguments(parser)
    flags = set(parser._option_string_actions)
    if (tool, sub) == ("runtime", "serve"):  # --disagg / --role hand the same line to the launcher
        from pdlab.runtime.disagg import launch

        more = arg_parser()
        launch.add_arguments(more)
        flags |= set(more._option_string_actions)
    return flags


def test_documented_pdlab_command_lines_use_existing_flags():
    tables, known, wrong, seen = _tables(), {}, [], 0
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench" / "gpu").glob("*.sh"))]
    for path in files:
        text = path.read_text().replace("\\\n", " ")  # shell line continuations
        for m in COMMAND.finditer(text):
            tool, sub, rest = m.groups()
            where = f"{path.relative_to(ROOT)}: pdlab {tool} {sub}"
            if sub not in tables[tool]:
                wrong.append(f"{where}: no such subcommand")
                continue
            flags = known.setdefault((tool, sub), _flags(tables, tool, sub))
            for flag in FLAG.findall(rest):
                seen += 1
                if flag not in flags:
                    wrong.append(f"{where}: no flag {flag}")
    assert seen > 50, f"only {seen} flags found: the pattern no longer matches how the docs write commands"
    assert not wrong, "\n".join(sorted(set(wrong)))
