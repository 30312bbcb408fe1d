"""PNG plots of a tuning run (matplotlib): per study its optimisation history, per op the speedup of
the stored config over the backend's default config, per bucket."""

from __future__ import annotations

import os
import re
from pathlib import Path


def plot_report(report, out_dir: str | os.PathLike) -> list[Path]:
    """Write `<out>/<op>/history/<backend>__<bucket>.png` per study and `<out>/<op>/speedup.png`."""
    out = Path(out_dir) / report.op
    paths = [plot_history(s, out / "history" / f"{_safe(s.backend)}__{_safe(_label(s.bucket))}.png",
                          title=f"{report.op} [{s.backend}] {_label(s.bucket)}")
             for s in report.studies if s.history]
    winners = report.winners()
    if winners:
        paths.append(plot_speedup(report.op, report.device, winners, out / "speedup.png"))
    return paths


def plot_history(study, path: Path, title: str) -> Path:
    """Trial value (ms) per trial number, best-so-far line, failed trials marked at the bottom."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [(n, v) for n, v, state in study.history if state == "COMPLETE" and v is not None]
    bad = [n for n, _, state in study.history if state == "FAIL"]
    if ok:
        xs, ys = zip(*ok)
        ax.scatter(xs, ys, s=14, label="trial")
        best, run = [], float("inf")
        for y in ys:
            run = min(run, y)
            best.append(run)
        ax.step(xs, best, where="post", color="C1", label="best so far")
        if study.default_time_ms:
            ax.axhline(study.default_time_ms, color="gray", linestyle="--", label="default config")
        if bad:
            ax.scatter(bad, [min(ys)] * len(bad), marker="x", color="red", s=18, label="failed")
    elif bad:
        ax.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    ax.set_xlabel("trial")
    ax.set_ylabel("time per call (ms)")
    ax.set_title(_wrap(title, 90), fontsize=9)  # a bucket label runs past the figure's edges on one line
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_speedup(op: str, device: str, winners, path: Path) -> Path:
    """One bar per bucket: default time / stored time of the winning backend."""
    import textwrap

    plt = _pyplot()
    # under each bar only the keys that differ between the buckets; the shared ones once, below the axis
    buckets = [b for b, _ in winners]
    keys = sorted({k for b in buckets for k in b})
    varying = [k for k in keys if len({str(b.get(k)) for b in buckets}) > 1]
    common = ",".join(f"{k}={buckets[0][k]}" for k in keys if k not in varying and k in buckets[0])
    labels = [f"{_label({k: b[k] for k in varying if k in b}) or _label(b)}\n[{s.backend}]" for b, s in winners]
    values = [(s.default_time_ms / s.time_ms) if s.default_time_ms else float("nan") for _, s in winners]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(labels)), 4.8 + 0.04 * max(map(len, labels))))
    ax.bar(range(len(values)), values, color=["C2" if v >= 1 else "C3" for v in values])
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks(range(len(labels)), labels, rotation=70, ha="right", fontsize=6)
    if varying and common:
        ax.set_xlabel("\n".join(textwrap.wrap(f"every bucket: {common}", 110)), fontsize=7)
    ax.set_ylabel("speedup over default config (×)")
    ax.set_title(f"{op} on {device}: tuned vs default", fontsize=10)
    return _save(fig, plt, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken after spaces or commas (bucket labels have no spaces)."""
    lines, line = [], ""
    for part in re.split(r"(?<=[ ,])", text):
        if line and len(line) + len(part) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
    return "\n".join(lines + [line.rstrip()])


def _label(bucket) -> str:
    return ",".join(f"{k}={bucket[k]}" for k in sorted(bucket))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", text)
