"""`tune show`: the tuned-config files this machine would read, whether each is used (metadata rule),
and their entries."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from datetime import datetime

from pdlab.kernels import tuned
from pdlab.tuning.store import DATE_FORMAT

# a bucket's backends measured further apart than this were timed in different runs (a run's studies of one bucket
# follow each other within minutes)
APART_HOURS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", default=None, help="only this op (e.g. mla_decode)")
    parser.add_argument("--device", default=None, help="device whose files to show: a torch device (cuda:1) or a "
                        "device name or key as the files are stored (\"NVIDIA H200\", NVIDIA_H200); default: this "
                        "machine's")
    parser.add_argument("--all-devices", action="store_true", help="also list files of other devices")
    parser.add_argument("--geomean", action="store_true", help="one line per file: buckets and the geometric-mean "
                        "speedup of the stored configs over the backend defaults")


def file_status(path, device_name: str) -> str:
    """'used', 'used (versions differ: ...)' or 'skipped: <why>' for one store file."""
    try:
        data = tuned.read_store(path)
    except (OSError, ValueError) as exc:
        return f"skipped: {exc}"
    meta = data["metadata"]
    if data.get("format") != tuned.FORMAT_VERSION:
        return f"skipped: format {data.get('format')!r} (this pdlab reads {tuned.FORMAT_VERSION})"
    if meta.get("device") != device_name:
        return f"skipped: tuned on {meta.get('device')!r}, this device is {device_name!r}"
    diff = [f"{k} {a}→{b}" for k, (a, b) in sorted(tuned.version_differences(meta.get("versions", {})).items())]
    return "used" + (f" (versions differ: {', '.join(diff)})" if diff else "")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from pdlab.tuning.command import device_problem

    problem = device_problem(args.device)
    if problem:
        print(f"tune show: {problem}", file=sys.stderr)
        return 2
    name, key, arch = _identity(args.device)
    console = Console(width=160)
    console.print(f"device {name} ({arch}), key {key}; roots searched in order: "
                  + ", ".join(f"{r}{_root_note(r)}" for r in tuned.config_roots()), soft_wrap=True, highlight=False)
    found = 0
    for root in tuned.config_roots():
        if _root_note(root):
            continue
        for dev_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            if dev_dir.name != key and not args.all_devices:
                continue
            for path in sorted(dev_dir.glob("*.json")):
                op = path.stem
                if args.op and op != args.op:
                    continue
                found += 1
                status = file_status(path, name)
                try:
                    data = tuned.read_store(path)
                except (OSError, ValueError):
                    console.print(f"[red]{path}: {status}[/red]")
                    continue
                meta = data["metadata"]
                if args.geomean:
                    console.print(geomean_line(path, data, status), soft_wrap=True, highlight=False, markup=False)
                    continue
                table = Table(title=f"{path} — {status}\n{meta.get('date', '?')}, model {meta.get('model', '?')}, "
                              f"{meta.get('command', '')}", title_justify="left")
                for col in ("bucket", "backend", "config", "tuned ms", "default ms", "speedup", "measured"):
                    table.add_column(col, overflow="fold")  # a bucket label has no spaces: cut, buckets look alike
                for label in sorted(data["entries"]):
                    e = data["entries"][label]
                    apart = measured_apart(e)
                    for bname, r in sorted(e.get("backends", {}).items()):
                        win = ("*" + ("~" if apart else "")) if bname == e.get("backend") else ""
                        knobs = ", ".join(f"{k}={v}" for k, v in (r.get("config") or {}).items())
                        table.add_row(label, bname + win, knobs,
                                      _f(r.get("time_ms")), _f(r.get("default_time_ms")), _f(r.get("speedup"), "x"),
                                      str(r.get("date") or "-"))
                console.print(table)
    if not found and args.op:
        from pdlab.bench.doctor import import_op_packages
        from pdlab.kernels import registry

        import_op_packages()
        if args.op not in registry.ops():
            print(f"tune show: --op {args.op!r} is no op; ops: {', '.join(registry.ops())}", file=sys.stderr)
            return 2
    if not found:
        others = sorted({d.name for r in tuned.config_roots() if not _root_note(r)
                         for d in r.iterdir() if d.is_dir() and any(d.glob("*.json"))} - {key})
        console.print(f"no tuned-config files for {key}" + (f" and op {args.op}" if args.op else "")
                      + ": every op runs its backend's default config"
                      + (f" (files are stored for: {', '.join(others)}; --device takes one of these)"
                         if others and args.device else ""), soft_wrap=True, highlight=False)
    console.print("* = fastest backend of the bucket; *~ = chosen from times measured more than "
                  f"{APART_HOURS:g} h apart (other runs: re-tune the bucket's backends together to compare like "
                  "with like). Lookup: nearest bucket by Σ|log2 ratio| over numeric keys, non-numeric keys equal; "
                  "the first root with a match wins.", style="dim")
    return 0


def _root_note(root) -> str:
    """Why a config root gives no files ('' when it can be listed): $PDLAB_CONFIG_DIR may name anything."""
    import os

    if not root.exists():
        return " (missing)"
    if not root.is_dir():
        return " (not a folder: ignored)"
    if not os.access(root, os.R_OK | os.X_OK):
        return " (not readable: ignored)"
    return ""


def _identity(device) -> tuple[str, str, str]:
    """(name, key, arch) for --device: a torch device, or the name / key of a device whose files are
    stored, in any letter case (the device need not be here: name and arch then come from the files' metadata)."""
    import torch

    if device is None or isinstance(device, int):
        return tuned.device_identity(device)
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        key = str(device).replace(" ", "_")
        stored = {d.name.lower(): d.name for r in tuned.config_roots() if not _root_note(r)
                  for d in r.iterdir() if d.is_dir()}
        key = stored.get(key.lower(), key)  # nvidia_h200 names the files of NVIDIA_H200
        for root in tuned.config_roots():
            if _root_note(root):
                continue
            for path in sorted((root / key).glob("*.json")):
                try:
                    meta = tuned.read_store(path)["metadata"]
                except (OSError, ValueError):
                    continue
                return meta.get("device", str(device)), key, meta.get("arch", "?")
        return str(device), key, "?"
    return tuned.device_identity(device)


def measured_apart(entry: Mapping, hours: float = APART_HOURS) -> bool:
    """Whether a bucket's backend choice rests on times measured more than `hours` apart (its timed backends'
    `date`s, ISO 8601 UTC); False with fewer than two timed backends or a date missing."""
    dates = []
    for r in entry.get("backends", {}).values():
        if not r.get("time_ms"):
            continue
        try:
            dates.append(datetime.strptime(r["date"], DATE_FORMAT))
        except (KeyError, TypeError, ValueError):
            return False
    return len(dates) > 1 and (max(dates) - min(dates)).total_seconds() > hours * 3600


def geomean_line(path, data: dict, status: str) -> str:
    """`<file>: N buckets, geometric-mean speedup X (min a, max b)[; by <key>: v X, ...][; with the backend
    choice, over each backend's default: b X (n), ...] [status]` over the winners: X is each winner's speedup over
    its own backend's default config; the breakdown for every non-numeric bucket key with several values (e.g.
    kv_dtype); where buckets searched several backends, the bucket's time against each backend's default config
    (what the op runs with that backend and no store), over the buckets that searched it, and how many of those
    choices compare times measured in different runs (`measured_apart`)."""
    from pdlab.tuning.search import geomean as gm

    timed = [e for e in data["entries"].values() if e.get("speedup")]
    xs = [e["speedup"] for e in timed]
    if not xs:
        return f"{path}: no timed entries [{status}]"
    parts = []
    keys = sorted({k for e in timed for k, v in e.get("bucket", {}).items() if isinstance(v, str)})
    for k in keys:
        groups: dict[str, list[float]] = {}
        for e in timed:
            groups.setdefault(str(e.get("bucket", {}).get(k)), []).append(e["speedup"])
        if len(groups) > 1:
            parts.append(f"by {k}: " + ", ".join(f"{v} {gm(g):.3f}x ({len(g)})" for v, g in sorted(groups.items())))
    if any(len(e.get("backends", {})) > 1 for e in timed):
        over: dict[str, list[float]] = {}
        for e in timed:
            for name, b in e.get("backends", {}).items():
                if b.get("default_time_ms") and e.get("time_ms"):
                    over.setdefault(name, []).append(b["default_time_ms"] / e["time_ms"])
        parts.append("with the backend choice, over each backend's default: "
                     + ", ".join(f"{name} {gm(v):.3f}x ({len(v)})" for name, v in sorted(over.items())))
        choices = [e for e in timed if len(e.get("backends", {})) > 1]
        apart = sum(map(measured_apart, choices))
        if apart:
            parts.append(f"{apart} of {len(choices)} backend choices from times measured over {APART_HOURS:g} h apart")
    return (f"{path}: {len(xs)} buckets, geometric-mean speedup over default {gm(xs):.3f}x "
            f"(min {min(xs):.3f}x, max {max(xs):.3f}x)" + "".join(f"; {p}" for p in parts) + f" [{status}]")


def _f(v, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.4g}{suffix}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(op=None, device=None, all_devices=True, geomean=False)))
