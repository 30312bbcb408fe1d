"""The installed package: import names, console scripts, tool help, not-yet-built subcommands."""

import importlib.metadata
import shutil
import subprocess
import sys

import pytest

from pdlab._subcommands import Subcommand, run_tool

SCRIPTS = {"pdlab": "pdlab.cli:main", "bench": "pdlab.bench.cli:main", "tune": "pdlab.tuning.cli:main",
           "runtime": "pdlab.runtime.cli:main"}


def _run(args, cwd):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_console_scripts_are_declared_and_installed():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
           if ep.dist is not None and ep.dist.name == "pdlab"}
    assert eps == SCRIPTS
    for name in SCRIPTS:
        assert shutil.which(name), f"console script {name!r} is not on PATH"


def test_no_top_level_kernels_module_in_a_clean_process(tmp_path):
    # pdlab's kernels/ is pdlab.kernels only: a top-level `kernels` (transformers probes for one; recent transformers
    # install the Hugging Face package of that name) must never be pdlab's folder
    code = ("import importlib.util, os, pdlab, pdlab.kernels.nvfp4, pdlab.bench.cli;"
            "spec = importlib.util.find_spec('kernels');"
            "root = os.path.dirname(os.path.abspath(pdlab.__file__));"
            "print(spec is None or not os.path.abspath(spec.origin or '').startswith(root + os.sep),"
            " pdlab.kernels.__name__)")
    proc = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "pdlab.kernels"]


@pytest.mark.parametrize("argv", [["pdlab", "--help"], ["pdlab", "bench", "--help"], ["bench", "--help"],
                                  ["tune", "--help"], ["runtime", "--help"],
                                  # each tool as a module too, package or cli module (no silent no-op)
                                  [sys.executable, "-m", "pdlab.bench", "--help"],
                                  [sys.executable, "-m", "pdlab.bench.cli", "--help"],
                                  [sys.executable, "-m", "pdlab.tuning", "--help"],
                                  [sys.executable, "-m", "pdlab.runtime.cli", "--help"]])
def test_help_works(argv, tmp_path):
    proc = _run(argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_pdlab_lists_tools_and_rejects_unknown(tmp_path):
    proc = _run(["pdlab", "--help"], cwd=tmp_path)
    assert all(t in proc.stdout for t in ("bench", "tune", "runtime"))
    proc = _run(["pdlab", "nope"], cwd=tmp_path)
    assert proc.returncode == 2 and "unknown tool 'nope'" in proc.stderr
    proc = _run(["bench", "nope"], cwd=tmp_path)
    assert proc.returncode == 2 and "unknown subcommand 'nope'" in proc.stderr
    proc = _run(["bench", "quantize", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and "--measure-peaks" in proc.stdout


def test_subcommand_not_built_yet_exits_2_with_one_line(capsys):
    table = {"later": Subcommand("pdlab.bench._not_built_in_this_version", "arrives later")}
    assert run_tool("bench", "test tool", table, ["later", "--flag"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "bench later: not built yet in this version of pdlab"


def test_subcommand_with_broken_import_is_not_hidden():
    table = {"broken": Subcommand("pdlab.kernels.nvfp4", "exists")}
    # a module without add_arguments is a bug, not "not built yet"
    with pytest.raises(AttributeError):
        run_tool("bench", "test tool", table, ["broken"])


def test_version():
    import pdlab

    assert importlib.metadata.version("pdlab") == pdlab.__version__
