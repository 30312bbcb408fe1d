"""Every Python file of pdlab compiles and every GPU shell script parses, though no CPU test runs the scripts under
bench/gpu/: a syntax error the parser lets through (a keyword argument given twice) fails here, not on the GPU
machine."""

import pathlib

import pdlab

ROOT = pathlib.Path(pdlab.__file__).parent


def test_every_source_file_compiles():
    files = [p for p in ROOT.rglob("*.py") if ".whl" not in p.relative_to(ROOT).parts]
    assert len(files) > 100 and any(p.parent.name == "gpu" for p in files)
    broken = []
    for path in files:
        try:
            compile(path.read_text(), str(path), "exec", dont_inherit=True)
        except SyntaxError as e:
            broken.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not broken, "\n".join(broken)


def test_every_shell_script_parses():
    """`bash -n` over the GPU scripts (bench/gpu/*.sh), which only a GPU machine runs."""
    import shutil
    import subprocess

    scripts = sorted(ROOT.glob("bench/gpu/*.sh"))
    assert scripts and shutil.which("bash")
    broken = {}
    for path in scripts:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if r.returncode:
            broken[str(path.relative_to(ROOT))] = r.stderr.strip()
    assert not broken, broken
