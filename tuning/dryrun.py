"""`tune ... --dry-run`: what would be searched for a target arch, printed with rich, no GPU needed."""

from __future__ import annotations

from pdlab.kernels.registry import _has_package
from pdlab.tuning.search import GRID_MAX
from pdlab.tuning.target import space_size


def print_plan(plans, arch: str, detected: str, model, args) -> None:
    """plans: [(TuneTarget, buckets)]. One backends table and one buckets summary per op."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(f"[bold]tune dry run[/bold]: target arch [bold]{arch}[/bold] (this machine: {detected}); "
                  f"model {model.name}; budget {args.budget} per op"
                  + (f", {args.bucket_budget} per bucket" if args.bucket_budget else ""))
    for target, buckets in plans:
        backends = target.backends(arch)
        if args.backends:
            backends = [b for b in backends if b.name in args.backends.split(",")]
        table = Table(title=f"{target.op}: backends searched on {arch}", title_justify="left")
        for col in ("backend", "archs", "packages", "space", "sampler", "buckets"):
            table.add_column(col, overflow="fold")
        lines = []
        for b in backends:
            n = space_size(b.config_space)
            sampler = "default only" if not b.config_space else (
                args.sampler if args.sampler != "auto" else ("grid" if n <= GRID_MAX else "tpe"))
            pkgs = ", ".join(f"{p}{'' if _has_package(p) else ' (not here)'}" for p in b.packages) or "-"
            accepted = sum(1 for bk in buckets if target.accepts(b, bk))
            if b.reference and target.reference_output is None and not (args.backends and b.name in args.backends.split(",")):
                sampler, accepted_text = "not searched: the reference", "-"
            else:
                accepted_text = f"{accepted}/{len(buckets)}"
            table.add_row(b.name + (" (reference)" if b.reference else ""), ",".join(b.archs), pkgs,
                          f"{n} configs", sampler, accepted_text)
            knobs = "; ".join(f"{k}: {list(v)}" for k, v in b.config_space.items()) or "no knobs"
            default = ", ".join(f"{k}={v}" for k, v in b.default_config.items()) or "-"
            lines.append(f"  {b.name}: {knobs}  (default {default})")
        console.print(table)
        for line in lines:
            console.print(line, soft_wrap=True, highlight=False)
        if not backends:
            console.print(f"  no backend of {target.op} is registered for {arch}")
        for mod, err in target.import_errors.items():
            console.print(f"  [yellow]could not import {mod}: {err}[/yellow]")
        axes: dict[str, list] = {}
        for bk in buckets:
            for k, v in bk.items():
                if v not in axes.setdefault(k, []):
                    axes[k].append(v)
        console.print(f"[bold]{target.op}[/bold]: {len(buckets)} buckets ({target.bucket_doc})")
        for k, vals in axes.items():
            console.print(f"  {k}: {', '.join(str(v) for v in vals)}")
        studies = sum(1 for b in backends for bk in buckets if target.accepts(b, bk)
                      and (not b.reference or target.reference_output is not None
                           or (args.backends and b.name in args.backends.split(","))))
        console.print(f"  {studies} studies (one per backend × bucket)\n")
