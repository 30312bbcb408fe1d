"""Backend registry: one registration per (op, backend), selection by name or preference.

A backend file registers its implementation once, at import::

    @register_backend("mla_decode", "triton", archs=("cuda",), packages=("triton",), priority=50,
                      config_space={"BLOCK_N": [32, 64], "num_warps": [4, 8]},
                      default_config={"BLOCK_N": 64, "num_warps": 4})
    def mla_decode_triton(q, kv_cache, block_table, seqlens, *, softmax_scale, config): ...

Archs: "cpu", "cuda" (any CUDA GPU), or specific families "sm90", "sm100", ... Packages are import
names, probed with importlib (not imported). `probe` is an optional callable returning None when
usable, else the reason it is not. Nothing outside a backend's own file branches on its name.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from pdlab.kernels.arch import arch_family, detect_arch


@dataclass
class Backend:
    """One registered implementation of an op.

    config_space: knob → list of values the tuner may try (anything that changes speed, not results).
    default_config: the values used when nothing is tuned. options: what the backend supports
    beyond the contract (e.g. {"page_sizes": (64,), "kv_dtypes": ("bf16",)}), for selection and docs.
    """

    op: str
    name: str
    impl: Callable[..., Any]
    archs: tuple[str, ...]
    packages: tuple[str, ...] = ()
    probe: Callable[[], str | None] | None = None
    priority: int = 0
    config_space: Mapping[str, list] = field(default_factory=dict)
    default_config: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    reference: bool = False  # the op's oracle (torch, fp32)
    doc: str = ""

    def runs_on(self, arch: str) -> bool:
        fam = arch_family(arch)
        if arch == "cpu":
            return "cpu" in self.archs
        return "cuda" in self.archs or fam in self.archs or arch in self.archs

    def unavailable_reason(self, arch: str | None = None) -> str | None:
        """None if the backend can run here, else a one-line reason."""
        arch = arch or detect_arch()
        if not self.runs_on(arch):
            return f"needs {'/'.join(self.archs)}, this machine is {arch}"
        missing = [p for p in self.packages if not _has_package(p)]
        if missing:
            return f"package {', '.join(missing)} not installed"
        if self.probe is not None:
            try:
                return self.probe()
            except Exception as exc:  # a probe must never take the caller down
                return f"probe failed: {type(exc).__name__}: {exc}"
        return None

    def config(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        cfg = dict(self.default_config)
        if overrides:
            unknown = set(overrides) - set(self.config_space) - set(self.default_config)
            if unknown:
                raise ValueError(f"{self.op}[{self.name}]: unknown config keys {sorted(unknown)}; "
                                 f"known: {sorted(set(self.config_space) | set(self.default_config))}")
            cfg.update(overrides)
        return cfg


_REGISTRY: dict[str, dict[str, Backend]] = {}
_PROBE_CACHE: dict[tuple[str, str, str], str | None] = {}


def register_backend(op: str, name: str, *, archs: tuple[str, ...], packages: tuple[str, ...] = (),
                     probe: Callable[[], str | None] | None = None, priority: int = 0,
                     config_space: Mapping[str, list] | None = None,
                     default_config: Mapping[str, Any] | None = None,
                     options: Mapping[str, Any] | None = None, reference: bool = False):
    """Decorator registering `impl` as backend `name` of `op`. Re-registering the same name replaces it."""

    def deco(impl: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY.setdefault(op, {})[name] = Backend(
            op, name, impl, tuple(archs), tuple(packages), probe, priority, dict(config_space or {}),
            dict(default_config or {}), dict(options or {}), reference, (impl.__doc__ or "").strip())
        _PROBE_CACHE.clear()
        return impl

    return deco


def ops() -> list[str]:
    return sorted(_REGISTRY)


def backends(op: str) -> list[Backend]:
    """All registered backends of `op`, best preference first."""
    if op not in _REGISTRY:
        raise KeyError(f"no op named {op!r} is registered; known ops: {', '.join(ops()) or 'none'}")
    return sorted(_REGISTRY[op].values(), key=lambda b: -b.priority)


def get_backend(op: str, name: str) -> Backend:
    table = _REGISTRY.get(op, {})
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise KeyError(f"{op} has no backend named {name!r}; registered: {known}")
    return table[name]


def unregistered(ops: Sequence[str], names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the names that no op of `ops` registered, every name those ops registered, sorted)."""
    known = sorted(set().union(*(_REGISTRY.get(op, {}) for op in ops)))
    return [n for n in names if n not in known], known


def unknown_names(op: str, names: Sequence[str]) -> str | None:
    """None when every name is a registered backend of `op`, else one line naming the unknown ones and the
    registered names (a typo on a command line is an error, not a backend that is "unavailable here")."""
    bad, known = unregistered([op], names)
    if not bad:
        return None
    return f"{op} has no backend named {', '.join(map(repr, bad))}; registered: {', '.join(known) or 'none'}"


def unavailable_reason(op: str, name: str, arch: str | None = None) -> str | None:
    arch = arch or detect_arch()
    key = (op, name, arch)
    if key not in _PROBE_CACHE:
        _PROBE_CACHE[key] = get_backend(op, name).unavailable_reason(arch)
    return _PROBE_CACHE[key]


def available(op: str, arch: str | None = None) -> list[Backend]:
    """Backends of `op` usable on this machine (or `arch`), best preference first."""
    return [b for b in backends(op) if unavailable_reason(op, b.name, arch) is None]


def select(op: str, name: str | None = None, device: torch.device | str | None = None,
           accept: Callable[[Backend], bool] | None = None) -> Backend:
    """The backend to run: `name` if given (error if unusable here), else the most preferred usable
    one for which `accept` (e.g. a page-size or dtype filter) is true."""
    arch = detect_arch(device) if device is not None else detect_arch()
    if name is not None:
        backend = get_backend(op, name)
        reason = unavailable_reason(op, name, arch)
        if reason:
            usable = ", ".join(b.name for b in available(op, arch)) or "none"
            raise RuntimeError(f"{op} backend {name!r} is unavailable: {reason}. Usable here: {usable}")
        return backend
    for backend in available(op, arch):
        if accept is None or accept(backend):
            return backend
    reasons = "; ".join(f"{b.name}: {unavailable_reason(op, b.name, arch) or 'rejected for these inputs'}"
                        for b in backends(op))
    raise RuntimeError(f"no usable backend for {op} on {arch} ({reasons})")


def matrix(arch: str | None = None) -> list[dict[str, Any]]:
    """Rows op × backend with availability and reason, for `bench list` / `runtime doctor`."""
    arch = arch or detect_arch()
    rows = []
    for op in ops():
        for b in backends(op):
            reason = unavailable_reason(op, b.name, arch)
            rows.append({"op": op, "backend": b.name, "archs": ",".join(b.archs),
                         "packages": ",".join(b.packages), "available": reason is None,
                         "reason": reason or "", "reference": b.reference})
    return rows


def _has_package(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
