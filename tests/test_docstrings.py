"""Every public function and method of pdlab (kernels, ops, runtime, bench, tuning) that takes or returns an annotated
tensor has a docstring naming shapes (`[B, H, 576]`-style brackets): a new op without one fails here. Recorded
results (bench/results/) are not pdlab's code and are left out."""

import ast
import pathlib
import re

import pdlab

ROOT = pathlib.Path(pdlab.__file__).parent
SHAPE = re.compile(r"\[[^\]]*\]")


def _public_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from (n for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))


def _is_kernel(fn: ast.FunctionDef) -> bool:  # @triton.jit / @gluon.jit device code: documented at its launcher
    return any(isinstance(d, (ast.Name, ast.Attribute)) and ast.unparse(d).endswith("jit") for d in fn.decorator_list)


def _takes_tensors(fn: ast.FunctionDef) -> bool:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    annotations = [a.annotation for a in args if a.annotation is not None] + [fn.returns] * (fn.returns is not None)
    return any("Tensor" in ast.unparse(a) for a in annotations)


def test_public_functions_with_tensors_name_their_shapes():
    missing, checked = [], 0
    for pkg in ("attention", "moe", "kernels", "runtime", "bench", "tuning"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "results" in path.relative_to(ROOT).parts:
                continue
            for fn in _public_functions(ast.parse(path.read_text(), str(path))):
                if _is_kernel(fn) or not _takes_tensors(fn):
                    continue
                checked += 1
                doc = ast.get_docstring(fn) or ""
                if not SHAPE.search(doc):
                    missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}"
                                   + (" (no docstring)" if not doc else " (no [shape] in its docstring)"))
    assert checked > 80
    assert not missing, "\n".join(missing)
