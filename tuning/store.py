"""Writing tuned-config files: `<root>/<device_key>/<op>.json`, atomically and merge-on-write.

The format is read by `pdlab.kernels.tuned` (lookup rule there and in docs/tuning.md)::

    {"format": 1, "op": "mla_decode",
     "metadata": {"device": "NVIDIA H200", "device_key": "NVIDIA_H200", "arch": "sm90",
                  "versions": {"torch": "2.11.0", "triton": "3.6.0", "flash_mla": null, ...},
                  "date": "2026-11-29T21:00:00Z", "model": "deepseek-r1", "model_shape": {...},
                  "command": "tune attention ...", "commit": "abc1234"},
     "entries": {"batch=8,heads=128,kv_dtype=bf16,seqlen=4096": {
         "bucket": {"batch": 8, "heads": 128, "kv_dtype": "bf16", "seqlen": 4096},
         "backend": "triton",                       # fastest backend of this bucket
         "config": {...}, "time_ms": 0.05, "default_time_ms": 0.07, "speedup": 1.4,
         "backends": {"triton": {"config": {...}, "time_ms": ..., "default_time_ms": ...,
                                 "speedup": ..., "trials": 40, "failed": 3, "date": ...}}}}}

Writers hold an exclusive `fcntl` lock on `<op>.json.lock` while they read the file, merge their
entries in (per bucket, per backend: the newer result replaces the older one) and replace the file
through a temporary file + `os.replace`, so readers never see a half-written file and concurrent
writers never lose each other's entries.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from pdlab.kernels.tuned import FORMAT_VERSION, bucket_label, read_store, upgrade_bucket

log = logging.getLogger("pdlab.tuning")

DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # a result's `date`: when it was measured, UTC


def store_path(root: str | os.PathLike, device_key: str, op: str) -> Path:
    """`<root>/<device_key>/<op>.json`."""
    return Path(root) / device_key / f"{op}.json"


def backend_result(config: Mapping, time_ms: float | None, default_time_ms: float | None,
                   trials: int = 0, failed: int = 0, study: str = "") -> dict:
    """One backend's result in a bucket; speedup = default_time / time (None without a default)."""
    speedup = (default_time_ms / time_ms) if (time_ms and default_time_ms) else None
    return {"config": dict(config), "time_ms": time_ms, "default_time_ms": default_time_ms,
            "speedup": speedup, "trials": trials, "failed": failed, "study": study,
            "date": time.strftime(DATE_FORMAT, time.gmtime())}


def write_results(root: str | os.PathLike, device_key: str, op: str, metadata: Mapping,
                  results: Mapping[str, tuple[Mapping, Mapping[str, dict]]]) -> Path:
    """Merge `results` (bucket label → (bucket, {backend: backend_result})) into the store file of
    (device_key, op) under `root` and return its path. The file's metadata becomes `metadata`
    (which must name the same device as the file already on disk, if any)."""
    path = store_path(root, device_key, op)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if path.exists():
            _set_aside_if_malformed(path)  # then a fresh file below
        if path.exists():
            data = read_store(path)
            old_dev = data["metadata"].get("device")
            if old_dev is not None and old_dev != metadata.get("device"):
                raise ValueError(f"{path} holds results for {old_dev!r}, not {metadata.get('device')!r}; "
                                 "use a folder per device")
        else:
            data = {"format": FORMAT_VERSION, "op": op, "metadata": {}, "entries": {}}
        data["format"] = FORMAT_VERSION
        data["metadata"] = dict(metadata)
        data["entries"] = _upgraded(op, data["entries"])
        for label, (bucket, per_backend) in results.items():
            entry = data["entries"].setdefault(label, {"bucket": dict(bucket), "backends": {}})
            entry["bucket"] = dict(bucket)
            entry["backends"].update({b: dict(r) for b, r in per_backend.items()})
            _pick_winner(entry)
        _atomic_write(path, data)
    return path


def _upgraded(op: str, entries: Mapping[str, dict]) -> dict[str, dict]:
    """`entries` with their buckets (and labels) as the op keys them now; where an old entry's upgraded label
    is already taken, the entry already under that label stays."""
    out: dict[str, dict] = {}
    for label, entry in entries.items():
        bucket = upgrade_bucket(op, entry.get("bucket", {}))
        new = bucket_label(bucket) if bucket != entry.get("bucket") else label
        if new in entries and new != label:
            continue
        out[new] = {**entry, "bucket": bucket}
    return out


def merge_bucket(bucket: Mapping, per_backend: Mapping[str, dict]) -> dict[str, tuple[Mapping, Mapping]]:
    """`{label: (bucket, per_backend)}` for one bucket, the argument shape of `write_results`."""
    return {bucket_label(bucket): (dict(bucket), dict(per_backend))}


def _pick_winner(entry: dict) -> None:
    timed = [(r["time_ms"], name) for name, r in entry["backends"].items() if r.get("time_ms")]
    if not timed:
        entry.update(backend=None, config=None, time_ms=None, default_time_ms=None, speedup=None)
        return
    _, name = min(timed)
    r = entry["backends"][name]
    entry.update(backend=name, config=r["config"], time_ms=r["time_ms"],
                 default_time_ms=r["default_time_ms"], speedup=r["speedup"])


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _set_aside_if_malformed(path: Path) -> bool:
    """Rename a store file that cannot be read (truncated, hand-edited, not a store) to `<name>.malformed-<time>`,
    with a warning, so that a run's results are written instead of lost; True when it did."""
    try:
        read_store(path)
        return False
    except ValueError as exc:
        aside = path.with_name(f"{path.name}.malformed-{time.strftime('%Y%m%dT%H%M%S')}")
        path.replace(aside)
        log.warning("%s; kept it as %s and writing a new file", exc, aside.name)
        return True


def _atomic_write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
