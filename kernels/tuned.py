"""Tuned-config lookup: which configuration an op's backend runs with, for this device and shape.

Files (written by `tune`, see docs/tuning.md)::

    <root>/<device_key>/<op>.json        e.g. tuning/configs/NVIDIA_H200/mla_decode.json

Roots, searched in this order: `$PDLAB_CONFIG_DIR` (a user folder, overrides), then the folder
shipped in the package (`pdlab/tuning/configs/`). `device_key` is `DeviceFacts.key` ("NVIDIA_H200",
"cpu"). A file holds `metadata` (device name, arch, library versions, date, model shape, command)
and `entries`: bucket → per-backend results (config, time_ms, default_time_ms, speedup) plus the
winning backend.

Lookup rule (`resolve_config`):
1. An explicit config from the caller wins: (backend default + explicit overrides, "explicit").
2. Else the user root, then the shipped root: the first file with an entry for this backend whose
   bucket is comparable gives the config of its *nearest* bucket. Comparable = same key set, and
   equal values in every non-numeric field (e.g. `kv_dtype`). Distance = Σ over numeric keys of
   |log2(max(query, 1)) − log2(max(entry, 1))|; ties go to the entry with the larger values (a
   kernel tuned for more work is the safer choice), then to the first in key order. A query outside
   the tuned range therefore gets the nearest edge bucket.
   Stored buckets are first read through the op's registered upgrade (`register_bucket_upgrade`),
   which fills keys an op's bucket gained after a file was written.
3. Metadata rule: a file whose `metadata.device` differs from the running device's name, or whose
   format version is unknown, is skipped (one warning per file). A file measured with other
   torch / triton / vendor package versions is used, with one warning per file.
4. No entry → (backend default config, "default"), logged once per (op, backend) at INFO.

The result is cached per (op, backend, bucket, device, $PDLAB_CONFIG_DIR); `clear_cache()` forgets
it (after writing new files in the same process).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from pdlab.kernels import registry
from pdlab.kernels.arch import device_facts

FORMAT_VERSION = 1
CONFIG_DIR_ENV = "PDLAB_CONFIG_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning" / "configs"

# distribution names whose versions a store file may record (import name → distribution name)
VERSION_PACKAGES = {"torch": "torch", "triton": "triton", "flash_mla": "flash_mla",
                    "flashinfer": "flashinfer-python", "deep_ep": "deep_ep",
                    "cutlass": "nvidia-cutlass-dsl"}

log = logging.getLogger("pdlab.tuned")

_RESOLVED: dict[tuple, tuple[dict, str]] = {}
_FILES: dict[tuple[str, float], dict | None] = {}
_FACTS: dict[str, tuple[str, str, str]] = {}
_WARNED: set = set()
_OBSERVERS: list[list] = []
_ADAPTERS: dict[tuple[str, str], Any] = {}
_UPGRADES: dict[str, Any] = {}
_CLEAR_HOOKS: list = []


def register_adapter(op: str, backend: str, fn) -> None:
    """Carry configs of `op`[`backend`] tuned at one bucket over to another: fn(config, tuned_bucket, call_bucket)
    returns the config for the call (e.g. a split count that sets how many programs fill the GPU, tuned at batch
    128, means twice as many splits at batch 64). Applied whenever the nearest tuned bucket is not the call's."""
    _ADAPTERS[(op, backend)] = fn


def register_bucket_upgrade(op: str, fn) -> None:
    """Read `op`'s stored buckets through fn(bucket) -> bucket, which fills in keys the op's bucket gained after
    files were written (e.g. moe_experts' `active_experts`: older entries were all measured with every expert
    holding tokens, so it equals their `experts`). Lookups and the store writer both apply it."""
    _UPGRADES[op] = fn


def upgrade_bucket(op: str, bucket: Mapping[str, int | str]) -> dict:
    """`bucket` as `op` keys it now (see `register_bucket_upgrade`); unchanged for ops without an upgrade."""
    fn = _UPGRADES.get(op)
    return dict(fn(dict(bucket))) if fn is not None else dict(bucket)


def resolve_config(op: str, backend: str, bucket: Mapping[str, int | str], device=None,
                   explicit: Mapping[str, Any] | None = None) -> tuple[dict, str]:
    """The config `backend` of `op` should run with at this shape.

    Args:
        op: op name, e.g. "mla_decode".
        backend: registered backend name, e.g. "triton".
        bucket: shape key of the call, e.g. {"batch": 64, "seqlen": 4096, "heads": 128,
            "kv_dtype": "bf16"}: ints (matched by nearest log2 distance) and strings (matched exactly).
        device: torch device / index / name of the device the call runs on (default: current CUDA
            device, else CPU).
        explicit: a config given by the caller; wins over any tuned entry.
    Returns:
        (config dict, source) with source "explicit", "tuned:<file>" or "default"; the config is the
        backend's default updated with the chosen values.
    """
    if explicit is not None:
        return _with_defaults(op, backend, explicit, strict=True), "explicit"
    for seen in _OBSERVERS:
        seen.append((op, backend, dict(bucket)))
    name, key, _arch = _device(device)
    user = os.environ.get(CONFIG_DIR_ENV, "")
    cache_key = (op, backend, tuple(sorted((k, str(v)) for k, v in bucket.items())), name, user)
    hit = _RESOLVED.get(cache_key)
    if hit is not None:
        return dict(hit[0]), hit[1]
    result = None
    for root in config_roots():
        path = root / key / f"{op}.json"
        data = _load(path, name)
        if data is None:
            continue
        entry = nearest_entry(data.get("entries", {}), backend, bucket, op=op)
        if entry is None:
            continue
        cfg = entry["backends"][backend]["config"]
        adapt = _ADAPTERS.get((op, backend))
        stored = upgrade_bucket(op, entry.get("bucket", {}))
        if adapt is not None and bucket_distance(bucket, stored) > 0:
            cfg = adapt(dict(cfg), stored, dict(bucket))
        try:
            result = (_with_defaults(op, backend, cfg, strict=True), f"tuned:{_label(root, path)}")
        except ValueError as exc:  # stale file: a knob the backend no longer has
            _warn_once(("stale", str(path), backend), f"ignoring {path} for {op}[{backend}]: {exc}")
            continue
        break
    if result is None:
        if (op, backend) not in _WARNED:
            _WARNED.add((op, backend))
            log.info("no tuned config for %s[%s] on %s at %s: using the backend default", op, backend,
                     name, dict(bucket))
        result = (_with_defaults(op, backend, None, strict=False), "default")
    _RESOLVED[cache_key] = result
    return dict(result[0]), result[1]


def resolve_backend(op: str, bucket: Mapping[str, int | str], device=None) -> str | None:
    """The backend that won the nearest tuned bucket of `op` on this device, or None if untuned.
    Only comparable entries count (same rule as `resolve_config`)."""
    name, key, _arch = _device(device)
    for root in config_roots():
        data = _load(root / key / f"{op}.json", name)
        if data is None:
            continue
        entry = nearest_entry(data.get("entries", {}), None, bucket, op=op)
        if entry is not None:
            return entry["backend"]
    return None


def tuned_summary(op: str, backend: str, device=None) -> str | None:
    """Where `op`[`backend`] gets tuned configs on `device`: "tuned by shape: N buckets in FILE" for the first
    usable file with entries for this backend, else None. No lookup happens (no bucket, no once-only log)."""
    name, key, _arch = _device(device)
    for root in config_roots():
        path = root / key / f"{op}.json"
        data = _load(path, name)
        if data is None:
            continue
        n = sum(1 for e in data.get("entries", {}).values() if backend in e.get("backends", {}))
        if n:
            return f"tuned by shape: {n} buckets in {_label(root, path)}"
    return None


def store_fingerprint(op: str, device=None) -> int:
    """A 56-bit digest of everything `resolve_config` reads for `op` on `device`: the device's name and, per root
    in search order, the bytes of the op's file (missing = empty). Two processes with equal fingerprints resolve
    every bucket to the same config (collective ops compare it across ranks before trusting the store)."""
    import hashlib

    name, key, _arch = _device(device)
    h = hashlib.sha256(name.encode())
    for i, root in enumerate(config_roots()):
        try:
            data = (root / key / f"{op}.json").read_bytes()
        except OSError:
            data = b""
        h.update(f"|{i}:{len(data)}:".encode())
        h.update(data)
    return int.from_bytes(h.digest()[:7], "little")


def config_roots() -> list[Path]:
    """Folders searched, first wins: $PDLAB_CONFIG_DIR (if set), then the shipped folder."""
    roots = []
    user = os.environ.get(CONFIG_DIR_ENV)
    if user:
        roots.append(Path(user).expanduser())
    roots.append(SHIPPED_DIR)
    return roots


def bucket_distance(query: Mapping[str, int | str], entry: Mapping[str, int | str]) -> float:
    """Σ |log2 q − log2 e| over numeric keys; inf when key sets differ or a non-numeric value differs."""
    if set(query) != set(entry):
        return math.inf
    dist = 0.0
    for k, q in query.items():
        e = entry[k]
        if _numeric(q) and _numeric(e):
            dist += abs(math.log2(max(float(q), 1.0)) - math.log2(max(float(e), 1.0)))
        elif str(q) != str(e):
            return math.inf
    return dist


def nearest_entry(entries: Mapping[str, Mapping], backend: str | None,
                  bucket: Mapping[str, int | str], op: str | None = None) -> Mapping | None:
    """The entry (of `entries`, bucket-key → entry) nearest to `bucket` that has results for
    `backend` (any backend when None); None when no entry is comparable. With `op`, stored buckets are
    read through its registered upgrade first."""
    best, best_rank = None, None
    for label in sorted(entries):
        entry = entries[label]
        if backend is not None and (entry.get("backends", {}).get(backend) or {}).get("config") is None:
            continue
        if backend is None and not entry.get("backend"):
            continue
        stored = upgrade_bucket(op, entry.get("bucket", {})) if op is not None else entry.get("bucket", {})
        d = bucket_distance(bucket, stored)
        if math.isinf(d):
            continue
        bigger = -sum(math.log2(max(float(v), 1.0)) for v in stored.values() if _numeric(v))
        rank = (d, bigger)
        if best_rank is None or rank < best_rank:
            best, best_rank = entry, rank
    return best


def bucket_label(bucket: Mapping[str, int | str]) -> str:
    """Canonical text key of a bucket: "batch=8,heads=128,kv_dtype=bf16,seqlen=4096"."""
    return ",".join(f"{k}={bucket[k]}" for k in sorted(bucket))


def running_versions(packages: list[str] | None = None) -> dict[str, str | None]:
    """Installed versions of torch, triton and the vendor packages (None = not installed)."""
    out = {}
    for dist in packages or list(VERSION_PACKAGES.values()):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if "torch" in out:
        out["torch"] = torch.__version__
    return out


def version_differences(recorded: Mapping[str, str | None]) -> dict[str, tuple[str | None, str | None]]:
    """{package: (tuned, here)} for the recorded versions that differ here: torch and triton always; a vendor
    package only where it is installed both here and where the file was tuned (installed on one side only, its
    backend's entries are unused here or it was not searched: the other entries stay as measured)."""
    now = running_versions(list(recorded))
    return {k: (v, now.get(k)) for k, v in recorded.items()
            if now.get(k) != v and (k in ("torch", "triton") or (v is not None and now.get(k) is not None))}


def device_identity(device=None) -> tuple[str, str, str]:
    """(device name, device key, arch) of `device`, e.g. ("NVIDIA H200", "NVIDIA_H200", "sm90")."""
    return _device(device)


def read_store(path: str | os.PathLike) -> dict:
    """Parse one store file (no metadata checks). Raises ValueError naming the file when malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it or re-run `tune`") from exc
    if not isinstance(data, dict) or "entries" not in data or "metadata" not in data:
        raise ValueError(f"{path}: not a pdlab tuned-config file (needs 'metadata' and 'entries')")
    problem = _store_problem(data)
    if problem:
        raise ValueError(f"{path}: not a pdlab tuned-config file ({problem}); delete it or re-run `tune`")
    return data


def _store_problem(data: dict) -> str | None:
    """What in a parsed store the readers could not walk or compute with (a hand-edited or foreign file), else
    None: its parts must be objects, a winner a backend name, times and speedups finite numbers >= 0 (or null)."""
    if not isinstance(data["metadata"], dict):
        return f"'metadata' is a JSON {type(data['metadata']).__name__}, not an object"
    if not isinstance(data["metadata"].get("versions", {}), dict):
        return "'metadata.versions' is not an object"
    if not isinstance(data["entries"], dict):
        return f"'entries' is a JSON {type(data['entries']).__name__}, not an object"
    for label, entry in data["entries"].items():
        if not isinstance(entry, dict):
            return f"entry {label!r} is a JSON {type(entry).__name__}, not an object"
        for key in ("bucket", "backends"):
            if not isinstance(entry.get(key, {}), dict):
                return f"entry {label!r} has a '{key}' that is not an object"
        if not isinstance(entry.get("backend") or "", str):
            return f"entry {label!r} has a winning 'backend' {entry['backend']!r} that is not a backend name"
        bad = [name for name, r in entry.get("backends", {}).items() if not isinstance(r, dict)]
        if bad:
            return f"entry {label!r} has backend {bad[0]!r} whose result is not an object"
        for where, r in [("", entry)] + [(f" backend {name!r}", r) for name, r in entry.get("backends", {}).items()]:
            if not isinstance(r.get("config") or {}, dict):
                return f"entry {label!r}{where} has a 'config' that is not an object"
            for key in ("time_ms", "default_time_ms", "speedup"):
                v = r.get(key)
                if v is not None and not (_numeric(v) and math.isfinite(v) and v >= 0):
                    return f"entry {label!r}{where} has {key} {v!r}, not a number >= 0"
    return None


@contextmanager
def observe() -> Iterator[list[tuple[str, str, dict]]]:
    """Record the (op, backend, bucket) of every non-explicit lookup inside the block (the tuner
    uses it to check that an op asks for the bucket keys the store is written with)."""
    seen: list[tuple[str, str, dict]] = []
    _OBSERVERS.append(seen)
    try:
        yield seen
    finally:
        _OBSERVERS.remove(seen)


def clear_cache() -> None:
    """Forget resolved configs, loaded files and once-only warnings (after files changed), and every cache an op
    keeps of its own lookups (registered with `on_clear_cache`)."""
    _RESOLVED.clear()
    _FILES.clear()
    _WARNED.clear()
    for fn in _CLEAR_HOOKS:
        fn()


def on_clear_cache(fn) -> None:
    """Call fn() whenever `clear_cache` runs: for ops that cache resolved configs themselves (attention/ops.py)."""
    if fn not in _CLEAR_HOOKS:
        _CLEAR_HOOKS.append(fn)


# ---------------------------------------------------------------------------------------------


def _numeric(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _device(device) -> tuple[str, str, str]:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    k = str(device)
    if k not in _FACTS:
        facts = device_facts(device)
        _FACTS[k] = (facts.name, facts.key, facts.arch)
    return _FACTS[k]


def _label(root: Path, path: Path) -> str:
    return str(path.relative_to(SHIPPED_DIR)) if root == SHIPPED_DIR else str(path)


def _load(path: Path, device_name: str) -> dict | None:
    """The file's data if it exists and passes the metadata rule, else None (cached by mtime)."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    ck = (str(path), mtime)
    if ck in _FILES:
        return _FILES[ck]
    data: dict | None
    try:
        data = read_store(path)
    except (OSError, ValueError) as exc:
        _warn_once(("bad", str(path)), f"skipping tuned-config file: {exc}")
        data = None
    if data is not None:
        meta = data["metadata"]
        if data.get("format") != FORMAT_VERSION:
            _warn_once(("format", str(path)), f"skipping {path}: format {data.get('format')!r}, this pdlab "
                       f"reads format {FORMAT_VERSION}; re-run `tune`")
            data = None
        elif meta.get("device") != device_name:
            _warn_once(("device", str(path)), f"skipping {path}: tuned on {meta.get('device')!r}, this "
                       f"device is {device_name!r}")
            data = None
        else:
            diff = version_differences(meta.get("versions", {}))
            if diff:
                text = ", ".join(f"{k} {a} (tuned) vs {b} (here)" for k, (a, b) in sorted(diff.items()))
                _warn_once(("versions", str(path)), f"using {path} measured with other versions: {text}; "
                           "re-run `tune` if speed matters")
    _FILES[ck] = data
    return data


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def _with_defaults(op: str, backend: str, cfg: Mapping[str, Any] | None, strict: bool) -> dict:
    try:
        b = registry.get_backend(op, backend)
    except KeyError:
        return dict(cfg or {})
    return b.config(cfg) if strict else b.config()
