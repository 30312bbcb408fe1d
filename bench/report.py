"""Benchmark results: pandas DataFrame → CSV + provenance JSON, a rich table, matplotlib plots.

Every benchmark writes `<out>/<name>.csv`, `<out>/<name>.json` (the command line, git commit, date,
device and the rows) and its plots as PNG; `print_table` shows the same rows on the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pandas as pd

from pdlab.kernels.arch import DeviceFacts


def git_commit() -> str:
    """Short commit of this checkout (+ "-dirty" with uncommitted changes); $PDLAB_COMMIT wins, for a working tree
    copied onto another machine beside a .git that is not its own (git there would name an older commit)."""
    if os.environ.get("PDLAB_COMMIT"):
        return os.environ["PDLAB_COMMIT"]
    try:
        here = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(facts: DeviceFacts | None = None, extra: dict | None = None) -> dict:
    """Command line, commit, UTC date, device and library versions of this run."""
    import torch

    info = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if facts is not None:
        info.update(device=facts.name, arch=facts.arch, sm_count=facts.sm_count,
                    peaks_source=facts.peaks.source if facts.peaks else None)
    if extra:
        info.update(extra)
    return info


def save(df: pd.DataFrame, out_dir: str | os.PathLike, name: str, meta: dict | None = None) -> Path:
    """Write `<out_dir>/<name>.csv` and `<name>.json` (meta + rows); returns the CSV path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv = out / f"{name}.csv"
    df.to_csv(csv, index=False)
    payload = {"meta": meta or {}, "rows": json.loads(df.to_json(orient="records"))}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    return csv


def print_table(df: pd.DataFrame, title: str, columns: Sequence[str] | None = None,
                floatfmt: str = "{:.3g}") -> None:
    """Show rows as a rich table (plain text when rich is missing)."""
    cols = list(columns or df.columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(df[cols].to_string(index=False))
        return
    table = Table(title=title, show_lines=False)
    for c in cols:  # fold, never cut: a shape or bucket label has no spaces to wrap at, and cut ones look alike
        table.add_column(str(c), justify="right" if pd.api.types.is_numeric_dtype(df[c]) else "left", overflow="fold")
    cells = [[_cell(v, floatfmt) for v in row] for _, row in df[cols].iterrows()]
    for row in cells:
        table.add_row(*row)
    natural = sum(max([len(str(c))] + [len(r[i]) for r in cells]) + 3 for i, c in enumerate(cols)) + 1
    Console(width=min(max(120, natural), 240)).print(table)


def _cell(value: object, floatfmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return floatfmt.format(value) if isinstance(value, float) else str(value)


class ProgressBar:
    """Progress over `total` steps: a rich bar on a terminal; elsewhere (a log file, a pipe, CI), where rich shows
    nothing until the end, one plain line to stderr at most every `every_s` seconds and at the last step, so that
    long work redirected to a file still shows where it is. `advance(n, text)` counts steps, `note(text)` changes
    the text after the count (e.g. the best time so far). A context manager; enabled=False shows nothing."""

    def __init__(self, total: int, description: str, enabled: bool = True, every_s: float = 10.0, stream=None):
        self.total, self.description, self.enabled, self.every_s = total, description, enabled, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.text = 0, ""
        self._bar = self._task = None
        self._t0 = self._last = 0.0

    def __enter__(self) -> "ProgressBar":
        self._t0 = self._last = time.monotonic()
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                return self
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[note]}"), transient=False,
                                 console=Console(file=self.stream))
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total, note="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def advance(self, n: int = 1, text: str | None = None) -> None:
        self.done += n
        if text is not None:
            self.text = text
        self._show(final=self.done >= self.total)

    def note(self, text: str) -> None:
        self.text = text
        self._show()

    def _show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, note=self.text)
            return
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            print(f"{self.description}: {self.done}/{self.total} in {now - self._t0:.0f} s  {self.text}".rstrip(),
                  file=self.stream, flush=True)


@contextmanager
def progress(total: int, description: str) -> Iterator:
    """A `ProgressBar` over `total` steps; yields `advance(text=None)` (one step)."""
    with ProgressBar(total, description) as bar:
        yield lambda text=None: bar.advance(1, text or "")


def plot_bars(df: pd.DataFrame, x: str, y: str, group: str, path: str | os.PathLike, title: str,
              ylabel: str, hline: float | None = None, hline_label: str | None = None,
              logy: bool = False, hlines: Iterable[tuple[float, str]] = ()) -> Path:
    """Grouped bar chart: one bar per `group` value at each `x`; optional horizontal rooflines: `hline` (one, labelled
    `hline_label`) and/or `hlines` ((value, label) pairs, e.g. one peak per compute unit the rows ran on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pivot = df.pivot_table(index=x, columns=group, values=y, aggfunc="first", sort=False)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(pivot) * max(1, len(pivot.columns))), 4.5))
    pivot.plot.bar(ax=ax, logy=logy)
    lines = ([(hline, hline_label)] if hline is not None else []) + list(hlines)
    styles = (("red", "--"), ("darkorange", ":"), ("purple", "-."), ("gray", "--"), ("green", ":"))
    for (value, label), (color, dash) in zip(lines, styles * len(lines)):
        ax.axhline(value, color=color, linestyle=dash, label=label)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_stacked(df: pd.DataFrame, index: str, stages: Iterable[str], path: str | os.PathLike,
                 title: str, ylabel: str) -> Path:
    """Stacked bars: one bar per `index` value, one segment per stage column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(stages)
    data = df.set_index(index)[stages]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(data)), 4.5))
    data.plot.bar(stacked=True, ax=ax)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def _save(fig, path: str | os.PathLike) -> Path:
    """Write a matplotlib figure as PNG (parent folders created) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def default_out_dir(kind: str) -> Path:
    """`bench/results/<device_key>/<kind>` under the current directory unless PDLAB_RESULTS_DIR is set."""
    from pdlab.kernels.arch import device_facts

    root = Path(os.environ.get("PDLAB_RESULTS_DIR", "bench/results"))
    return root / device_facts().key / kind
