"""Every Python file of pdlab compiles, the GPU-only scripts under bench/gpu/ too, which no CPU test imports: a
syntax error the parser lets through (a keyword argument given twice) fails here, not on the GPU machine."""

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
