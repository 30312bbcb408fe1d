"""What `tune attention|moe|dispatch` share: flags, the `--arch` gate, `--dry-run`, the run and its summary."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from pdlab._subcommands import int_arg
from pdlab.bench._args import add_no_plot
from pdlab.kernels.arch import arch_family, detect_arch


def add_common_arguments(parser: argparse.ArgumentParser, ops: Sequence[str], default_op: str) -> None:
    parser.add_argument("--op", default=default_op, help=f"op(s) to tune, comma-separated: {', '.join(ops)} "
                        f"(default {default_op}; 'all' = every one)")
    parser.add_argument("--arch", default=None, help="target arch (sm90, sm100, ..., cpu); default: this machine's "
                        "GPU. Tuning must run on a device of that arch; see --dry-run")
    parser.add_argument("--dry-run", action="store_true", help="print backends, config spaces and buckets that "
                        "would be searched for --arch, without a GPU")
    parser.add_argument("--model", default="deepseek-r1", help="model whose shapes set the buckets: a name "
                        "(deepseek-r1, deepseek-v3) or an HF config.json (default deepseek-r1)")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=V1,V2",
                        help="keep buckets whose KEY is one of the values (repeatable), e.g. --only batch=1,64")
    parser.add_argument("--backends", default=None, help="comma-separated backends to search (default: all that "
                        "run here)")
    parser.add_argument("--budget", default="10m", help="wall-time budget per op, e.g. 90s, 10m, 1h; none or 0: "
                        "no limit (default 10m)")
    parser.add_argument("--bucket-budget", default=None, help="wall-time cap per bucket (all its backends); "
                        "default: the op budget shared evenly over the buckets")
    parser.add_argument("--trials", type=int_arg(1), default=200, help="max trials per study (default 200)")
    parser.add_argument("--sampler", default="auto", choices=["auto", "tpe", "grid", "random"],
                        help="auto: grid when a space has <= 64 configs, else TPE")
    parser.add_argument("--storage", default=None, help="optuna storage: a sqlite file path or an RDB URL "
                        "(default ~/.cache/pdlab/tuning.db); rerunning resumes its studies")
    parser.add_argument("--store", default=None, help="folder to write tuned configs into (default "
                        "$PDLAB_CONFIG_DIR, else ~/.cache/pdlab/configs)")
    parser.add_argument("--out", default=None, help="folder for the summary CSV/JSON and PNG plots (default "
                        "bench/results/<device>/tuning)")
    parser.add_argument("--repeats", type=int_arg(1), default=30, help="timed calls per measurement (default 30)")
    parser.add_argument("--warmup", type=int_arg(0), default=3, help="untimed calls before each measurement (the first "
                        "compiles a new config; default 3)")
    parser.add_argument("--seed", type=int_arg(0), default=0)
    parser.add_argument("--device", default=None, help="device to tune on (default cuda:current)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_no_plot(parser)


def parse_duration(text: str | None) -> float | None:
    """'90s' / '10m' / '1.5h' / '300' (seconds) → seconds; None, 'none', 'inf' and any zero duration ('0', '0s',
    '0m') → None (no limit)."""
    if text is None or str(text).lower() in ("none", "inf", "0", ""):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"duration {text!r}: write e.g. 90s, 10m, 1h or a number of seconds")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    return seconds or None  # a zero budget reads as none, whatever its unit


def parse_only(items: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--only {item!r}: write KEY=V1,V2 (e.g. batch=1,64)")
        k, v = item.split("=", 1)
        out.setdefault(k.strip(), []).extend(x.strip() for x in v.split(",") if x.strip())
    return out


_ARCH_NAME = re.compile(r"sm\d{2,3}[af]?")


def arch_problem(prog: str, requested: str | None) -> str | None:
    """The one-line refusal of an --arch that names no arch (a typo would plan for it, or be told to run on a
    device of that name), else None."""
    if requested is None or requested.lower() == "cpu" or _ARCH_NAME.fullmatch(requested.lower()):
        return None
    return (f"{prog}: --arch {requested!r} is not an arch; write sm<major><minor> as `bench list` shows it "
            "(sm90 for H100/H200, sm100 for B200/GB200, ...) or cpu")


def device_problem(text: str | None) -> str | None:
    """Why the torch device `text` is not on this machine (a CUDA device without CUDA, or past the last GPU),
    else None. Text that is no torch device is left to the caller."""
    import torch

    if not text:
        return None
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        return None
    if dev.type != "cuda":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"--device {text}: this machine has no CUDA device; leave --device out, or run on a GPU machine"
    if dev.index is not None and dev.index >= count:
        return f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def _device_kind_problem(text: str | None) -> str | None:
    """Why `text` is no device tune measures on (not a torch device, or neither CUDA nor CPU), else None."""
    import torch

    if text is None:
        return None
    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind in ("cuda", "cpu"):
        return None
    return f"--device {text!r}: tune measures on cuda, cuda:N or cpu"


def _folder_problem(path: Path, what: str) -> str | None:
    """Why `path` cannot take the files tune writes (made here if missing), else None."""
    from pdlab.bench._args import out_dir_problem

    problem = out_dir_problem(path)
    return f"{what}: {problem}" if problem else None


def arch_gate(prog: str, requested: str | None, detected: str, dry_run: bool) -> str | None:
    """The one-line refusal when this machine cannot tune for `requested`, else None."""
    if dry_run:
        return None
    if requested is None:
        if detected == "cpu":
            return (f"{prog}: no GPU detected (this machine is cpu) and no --arch given; tuning measures kernels on "
                    f"the target GPU — run it there, use --dry-run --arch sm90|sm100 to see the plan, or --arch cpu "
                    f"for CPU backends")
        return None
    if requested.lower() == "cpu":  # every machine has one
        return None
    if arch_family(requested.lower()) != arch_family(detected):
        return (f"{prog}: requested --arch {requested} but this machine is {detected}; tuning must run on a "
                f"{requested} device — use --dry-run to see what would be searched")
    return None


def run_tune(prog: str, args: argparse.Namespace, ops: Sequence[str], lockstep=None) -> int:
    """Body of `tune attention|moe|dispatch`: gate, then dry-run or search + store + report.
    lockstep: in a multi-rank run (see tuning/dispatch.py), rank 0 searches, the others follow."""
    problem = arch_problem(prog, args.arch)
    if not problem:  # tune measures: a device key or name (which `tune show` takes) is no device here
        device_why = _device_kind_problem(args.device) or device_problem(args.device)
        problem = f"{prog}: {device_why}" if device_why else None
    if problem:
        print(problem, file=sys.stderr)
        return 2
    detected = detect_arch(args.device) if args.device else detect_arch()
    refusal = arch_gate(prog, args.arch, detected, args.dry_run)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    arch = (args.arch or detected).lower()
    chosen = list(ops) if args.op == "all" else [o.strip() for o in args.op.split(",") if o.strip()]
    bad = [o for o in chosen if o not in ops]
    if bad:
        print(f"{prog}: --op {','.join(bad)} is not tuned here; choose from {', '.join(ops)} or all", file=sys.stderr)
        return 2
    from pdlab.tuning.models import cpu_shape, load_model_shape
    from pdlab.tuning.target import filter_buckets, get_target

    try:
        model = load_model_shape(args.model)
        small = cpu_shape(args.model, model) if arch == "cpu" else model
        if small is not model:
            model = small
            print(f"{prog}: --arch cpu: small shapes ({model.name}: {model.n_routed_experts} experts, top-"
                  f"{model.num_experts_per_tok}, hidden {model.hidden_size}, intermediate {model.moe_intermediate_size}"
                  f", {model.num_heads} heads) instead of {args.model}'s; pass a config.json to tune at its shapes")
        only = parse_only(args.only)
        budget = _duration("--budget", args.budget)
        bucket_budget = _duration("--bucket-budget", args.bucket_budget)
        plans = []
        for op in chosen:
            target = get_target(op)
            problem = target.model_problem(model)
            if problem:
                raise ValueError(f"--model {args.model!r}: {problem}")
            plans.append((target, filter_buckets(target.buckets(model), only)))
    except (ValueError, KeyError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    problem = _unknown_backends(args.backends, [t for t, _ in plans])
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    if args.dry_run:
        from pdlab.tuning.dryrun import print_plan

        print_plan(plans, arch, detected, model, args)
        return 0
    if lockstep is not None and lockstep.rank > 0:
        return _follow(args, plans, model, arch, lockstep)
    return _search(prog, args, plans, model, arch, budget, bucket_budget, lockstep)


def _duration(flag: str, text: str | None) -> float | None:
    """`parse_duration` of a flag's value; its ValueError names the flag."""
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: write e.g. 90s, 10m, 1h or a number of seconds (none or 0: no limit)") \
            from None


def _unknown_backends(text: str | None, targets) -> str | None:
    """None when every name of --backends is registered for at least one of the ops tuned, else one line naming the
    unknown ones and the registered names (a typo would otherwise plan zero studies and exit 0)."""
    if not text:
        return None
    from pdlab.kernels import registry

    for t in targets:
        t.load_backends()
    bad, known = registry.unregistered([t.op for t in targets], [x.strip() for x in text.split(",") if x.strip()])
    if not bad:
        return None
    return (f"--backends {','.join(bad)}: no such backend of {', '.join(t.op for t in targets)}; registered: "
            f"{', '.join(known) or 'none'}")


def _settings(args, budget, bucket_budget):
    from pdlab.tuning.search import SearchSettings, storage_url

    return SearchSettings(storage=storage_url(args.storage), budget_s=budget, bucket_budget_s=bucket_budget,
                          max_trials=args.trials, sampler=args.sampler, seed=args.seed, repeats=args.repeats,
                          warmup=args.warmup,
                          backends=args.backends.split(",") if args.backends else None,
                          show_progress=not args.no_progress)


def _device(args, arch):
    import torch

    return torch.device(args.device) if args.device else (
        torch.device("cuda", torch.cuda.current_device()) if arch != "cpu" else torch.device("cpu"))


def _follow(args, plans, model, arch, lockstep) -> int:
    from pdlab.tuning.search import follow

    settings = _settings(args, None, None)
    for target, buckets in plans:
        if buckets:
            follow(target, model, settings, _device(args, arch), lockstep)
    return 0


def _search(prog, args, plans, model, arch, budget, bucket_budget, lockstep=None) -> int:
    import pandas as pd
    import torch

    from pdlab.bench import report
    from pdlab.kernels import tuned
    from pdlab.kernels.arch import device_facts
    from pdlab.tuning.search import DeviceBroken, tune_op

    device = _device(args, arch)
    facts = device_facts(device)
    store_root = Path(args.store or os.environ.get(tuned.CONFIG_DIR_ENV) or
                      Path.home() / ".cache" / "pdlab" / "configs").expanduser()
    out_dir = Path(args.out) if args.out else report.default_out_dir("tuning")
    # checked before the search: a folder that cannot take the results would lose the measurements at the first write
    store_what = "--store" if args.store else (tuned.CONFIG_DIR_ENV if os.environ.get(tuned.CONFIG_DIR_ENV)
                                               else "the default store")
    problem = (_folder_problem(store_root, store_what)
               or _folder_problem(out_dir, "--out" if args.out else "the default --out"))
    if problem:
        print(f"{prog}: {problem}; point --store / {tuned.CONFIG_DIR_ENV} and --out at folders you can write",
              file=sys.stderr)
        return 2
    try:  # opened once here (it is cached for the run): a URL optuna cannot open ends the run before it starts
        from pdlab.tuning.search import _storage

        settings = _settings(args, budget, bucket_budget)
        _storage(settings.storage)
    except Exception as exc:  # noqa: BLE001  (sqlalchemy's and optuna's own errors, an uncreatable folder)
        print(f"{prog}: --storage {args.storage!r}: cannot open it as an optuna storage ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}); give a sqlite file path or an RDB URL",
              file=sys.stderr)
        return 2
    meta = report.provenance(facts, {"device_key": facts.key, "versions": tuned.running_versions(),
                                     "model": model.name, "model_shape": model.as_dict()})
    rows, status = [], 0
    for target, buckets in plans:
        if not buckets:
            print(f"{prog}: {target.op}: no bucket left after --only", file=sys.stderr)
            status = 2
            continue
        try:
            rep = tune_op(target, buckets, model, settings, device=device, store_root=store_root, metadata=meta,
                          plot_dir=None if args.no_plot else out_dir / "plots", lockstep=lockstep)
        except DeviceBroken as exc:
            print(f"{prog}: {target.op}: {exc}", file=sys.stderr)
            return 3
        except (RuntimeError, ValueError) as exc:
            print(f"{prog}: {target.op}: {exc}", file=sys.stderr)
            status = 1
            continue
        varying = [k for k in (rep.studies[0].bucket if rep.studies else {})
                   if len({str(s.bucket[k]) for s in rep.studies}) > 1]
        for s in rep.studies:
            rows.append({"op": rep.op, "bucket": tuned.bucket_label(s.bucket),
                         "shape": ",".join(f"{k}={s.bucket[k]}" for k in varying) or "(one bucket)",
                         "backend": s.backend,
                         "default_ms": s.default_time_ms, "tuned_ms": s.time_ms,
                         "speedup": (s.default_time_ms / s.time_ms) if s.default_time_ms and s.time_ms else None,
                         "trials": s.trials, "failed": s.failed, "config": str(s.config), "note": s.reason})
        g = rep.geomean_speedup()
        if rep.winners():
            print(f"{rep.op}: {len(rep.winners())} buckets stored in {rep.store_file or '(no store)'}; "
                  + (f"geometric-mean speedup over default {g:.3f}x" if g else "no default time to compare with")
                  + f"; tuning took {rep.seconds:.1f} s")
        else:  # every study failed or every bucket's inputs did: a failed run, whatever the buckets' reasons
            why = next((s.reason for s in rep.studies if s.reason), None) or next(
                (r for _, _, r in rep.skipped if r != "does not accept this bucket"), "no study finished")
            print(f"{prog}: {rep.op}: nothing stored ({why}); tuning took {rep.seconds:.1f} s", file=sys.stderr)
            status = 1
        for note in rep.notes:
            print(f"  WARNING: {note}")
        for bucket, backend, reason in rep.skipped:
            if reason != "does not accept this bucket":
                print(f"  skipped {backend} {tuned.bucket_label(bucket) if bucket else ''}: {reason}")
    if rows:
        df = pd.DataFrame(rows)
        report.print_table(df, f"tuning on {facts.name}", [c for c in df.columns if c not in ("config", "bucket")])
        report.save(df, out_dir, "tuning", meta)
        print(f"summary {'' if args.no_plot else 'and plots '}in {out_dir}")
    if rows and store_root.resolve() not in {r.resolve() for r in tuned.config_roots()}:  # stored where none reads
        print(f"to use these configs: export {tuned.CONFIG_DIR_ENV}={store_root}")
    return status
