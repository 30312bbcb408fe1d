"""`bench list` / `runtime doctor`: which backend of which op runs on this machine, and why not.

Imports every op package present (pdlab.kernels.nvfp4, pdlab.attention, pdlab.moe and their
submodules, so their backends register), then prints device facts and the registry matrix
op x backend x available / reason. A package that fails to import is listed with its error.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

OP_PACKAGES = ("pdlab.kernels.nvfp4", "pdlab.attention", "pdlab.moe")
VENDOR_PACKAGES = ("triton", "flash_mla", "deep_ep", "flashinfer", "cutlass", "nixl")
_SKIP_SUFFIXES = ("cli", "server", "__main__")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the matrix as JSON instead of tables")


def import_op_packages(packages=OP_PACKAGES) -> dict[str, str]:
    """Import each package and its submodules (so backends register); returns module → error text
    for those that failed."""
    errors: dict[str, str] = {}
    for name in packages:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # report, never fail: the table shows it
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not hasattr(module, "__path__"):
            continue
        for info in pkgutil.walk_packages(module.__path__, prefix=name + ".", onerror=lambda n: None):
            if info.name.rsplit(".", 1)[-1].startswith(_SKIP_SUFFIXES):
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:
                errors[info.name] = f"{type(exc).__name__}: {exc}"
    return errors


def facts_rows() -> list[tuple[str, str]]:
    import torch

    from pdlab.kernels import arch
    from pdlab.kernels.registry import _has_package

    facts = arch.device_facts()
    rows = [("device", facts.name), ("arch", facts.arch), ("SMs / CPU cores", str(facts.sm_count)),
            ("memory", f"{facts.memory_bytes / 2**30:.1f} GiB"), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        rows.append(("GPUs", str(torch.cuda.device_count())))
        rows.append(("CUDA", str(torch.version.cuda)))
    if facts.peaks:
        p = facts.peaks
        rows += [("HBM bandwidth", f"{p.hbm_bytes_per_s / 1e12:.2f} TB/s"),
                 ("bf16 / fp8 / fp4 dense", f"{p.bf16_flops / 1e12:.0f} / {p.fp8_flops / 1e12:.0f} / "
                                            f"{p.fp4_flops / 1e12:.0f} TFLOPS"),
                 ("fp32 CUDA cores (no TF32)", f"{p.fp32_flops / 1e12:.0f} TFLOPS" if p.fp32_flops else "unknown"),
                 ("peaks source", p.source)]
    for pkg in VENDOR_PACKAGES:
        rows.append((f"package {pkg}", "installed" if _has_package(pkg) else "not installed"))
    return rows


def run(args: argparse.Namespace) -> int:
    import json

    from pdlab.kernels import registry

    errors = import_op_packages()
    rows = registry.matrix()
    rows += [{"op": f"(import {mod})", "backend": "-", "archs": "", "packages": "", "available": False,
              "reason": err, "reference": False} for mod, err in errors.items()]
    if args.json:
        print(json.dumps({"device": dict(facts_rows()), "backends": rows}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    dev = Table(title="device", show_header=False)
    dev.add_column("fact")
    dev.add_column("value")
    for k, v in facts_rows():
        dev.add_row(k, v)
    console.print(dev)
    table = Table(title="op x backend on this machine")
    for col in ("op", "backend", "archs", "needs", "available", "reason"):
        table.add_column(col)
    for r in rows:
        name = r["backend"] + (" (reference)" if r["reference"] else "")
        table.add_row(r["op"], name, r["archs"], r["packages"] or "-",
                      "[green]yes[/]" if r["available"] else "[red]no[/]", r["reason"] or "")
    console.print(table)
    usable = sum(r["available"] for r in rows)
    console.print(f"{usable} of {len(rows)} backends usable here; {len(errors)} op modules failed to import")
    return 0
