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
            # the searched space per accepted bucket on this arch (a target may narrow it per bucket)
            spaces: dict[tuple, list] = {}
            for bk in buckets:
                if target.accepts(b, bk):
                    sp = target.search_space(b, bk, arch)
                    spaces.setdefault(tuple((k, tuple(v)) for k, v in sp.items()), []).append(bk)
            if not spaces:
                spaces[tuple((k, tuple(v)) for k, v in b.config_space.items())] = []
            sizes = sorted({space_size(dict(sp)) for sp in spaces})
            samplers = sorted({"default only" if not sp else args.sampler if args.sampler != "auto" else (
                "grid" if space_size(dict(sp)) <= GRID_MAX else "tpe") for sp in spaces})
            sampler = " / ".join(samplers)
            pkgs = ", ".join(f"{p}{'' if _has_package(p) else ' (not here)'}" for p in b.packages) or "-"
            accepted = sum(1 for bk in buckets if target.accepts(b, bk))
            if b.reference and target.reference_output is None and not (args.backends and b.name in args.backends.split(",")):
                sampler, accepted_text = "not searched: the reference", "-"
            else:
                accepted_text = f"{accepted}/{len(buckets)}"
            size_text = f"{sizes[0]} configs" if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]} configs by bucket"
            table.add_row(b.name + (" (reference)" if b.reference else ""), ",".join(b.archs), pkgs, size_text,
                          sampler, accepted_text)
            default = ", ".join(f"{k}={v}" for k, v in b.default_config.items()) or "-"
            for sp, bks in spaces.items():
                knobs = "; ".join(f"{k}: {list(v)}" for k, v in sp) or "no knobs"
                scope = f" ({len(bks)} buckets)" if len(spaces) > 1 else ""
                narrowed = "" if dict(sp) == {k: tuple(v) for k, v in b.config_space.items()} else \
                    " (the knobs that matter on this arch; the others keep their defaults)"
                lines.append(f"  {b.name}{scope}: {knobs}{narrowed}  (default {default})")
        console.print(table)
        for line in lines:
            console.print(line, soft_wrap=True, highlight=False)
        if not backends and args.backends and target.backends(arch):
            others = ", ".join(b.name for b in target.backends(arch))
            console.print(f"  none of --backends {args.backends} runs {target.op} on {arch} (there: {others})")
        elif not backends:
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
            if all(isinstance(v, int) for v in vals):
                vals = sorted(vals)
            console.print(f"  {k}: {', '.join(str(v) for v in vals)}")
        studies = sum(1 for b in backends for bk in buckets if target.accepts(b, bk)
                      and (not b.reference or target.reference_output is not None
                           or (args.backends and b.name in args.backends.split(","))))
        console.print(f"  {studies} studies (one per backend × bucket)\n")
