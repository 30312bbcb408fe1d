"""What the tuner needs to know about one op: its shape buckets at a model's shapes, how to build
inputs for a bucket, how to call one backend with one config through the op's public API, and how
close an output must be to the reference backend's output.

Config spaces are not declared here: they come from the registry (`Backend.config_space`,
`Backend.default_config`), next to the kernel they describe.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from pdlab.kernels import registry
from pdlab.kernels.registry import Backend
from pdlab.tuning.models import ModelShape


@dataclass
class TuneTarget:
    """One tunable op.

    op: registry op name. buckets(model) → list of bucket dicts (ints and strings). build(bucket,
    model, device) → an inputs object for `call`. call(backend_name, config, inputs) → output tensor(s),
    through the op's public function. error(out, ref) → float, 0 when equal; a trial whose error is
    above tolerance(bucket) (or NaN) is a wrong result. accepts(backend, bucket) says whether the
    backend supports the bucket at all (e.g. fp8 cache), so it is not searched there.
    reference_output(inputs), when given, is the expected output (else the reference backend's).
    resolve(backend_name, config, bucket) → the config with its "auto" knobs (0 / -1) replaced by
    the values the backend would pick for this bucket; the search starts next to that config.
    edge_inputs(bucket, model, device) → inputs at other shapes the bucket's stored config will also be
    handed in service (the store answers for the nearest bucket: other batch sizes, short and ragged
    sequences); the winner must match the reference on each before it is stored, else the next-best
    trial is checked.
    space(backend, bucket, arch) → the part of the backend's config space that changes its speed for this bucket on
    that arch ("sm90", ...; None, or a None answer: all of it); the knobs left out keep their defaults. `tune
    --dry-run` prints it for the target arch.
    model_problem(model) → why this op cannot be tuned at the model's sizes (one line naming them), else None;
    `tune` refuses such a model before planning.
    modules: imported before the registry is read (they register the backends)."""

    op: str
    description: str
    buckets: Callable[[ModelShape], list[dict]]
    build: Callable[[Mapping, ModelShape, torch.device], Any]
    call: Callable[[str, dict, Any], Any]
    error: Callable[[Any, Any], float]
    tolerance: Callable[[Mapping], float]
    accepts: Callable[[Backend, Mapping], bool] = lambda backend, bucket: True
    modules: Sequence[str] = ()
    reference: str | None = None
    reference_output: Callable[[Any], Any] | None = None  # computes the expected output itself
    resolve: Callable[[str, dict, Mapping], dict] = lambda backend, config, bucket: dict(config)
    edge_inputs: Callable[[Mapping, ModelShape, torch.device], list] | None = None
    cuda_graph: bool = False
    space: Callable[[Backend, Mapping, str], dict | None] | None = None
    bucket_doc: str = ""
    model_problem: Callable[[ModelShape], str | None] = lambda model: None
    import_errors: dict = field(default_factory=dict)

    def search_space(self, backend: Backend, bucket: Mapping, arch: str) -> dict:
        """The knobs searched for `backend` on `bucket` on `arch`: `space`'s answer, else the whole config space."""
        narrowed = self.space(backend, bucket, arch) if self.space is not None else None
        return dict(backend.config_space if narrowed is None else narrowed)

    def load_backends(self) -> None:
        """Import the modules that register this op's backends; failures are kept, not raised."""
        for mod in self.modules:
            if mod in self.import_errors:
                continue
            try:
                importlib.import_module(mod)
            except Exception as exc:  # an op package being rewritten must not break `tune --dry-run`
                self.import_errors[mod] = f"{type(exc).__name__}: {exc}"

    def backends(self, arch: str) -> list[Backend]:
        """Registered backends of the op that run on `arch` (packages not checked), preferred first."""
        self.load_backends()
        try:
            return [b for b in registry.backends(self.op) if b.runs_on(arch)]
        except KeyError:
            return []

    def reference_backend(self) -> Backend:
        self.load_backends()
        if self.reference:
            return registry.get_backend(self.op, self.reference)
        refs = [b for b in registry.backends(self.op) if b.reference]
        if not refs:
            raise RuntimeError(f"{self.op} has no reference backend registered (reference=True); the tuner "
                               "needs one to check each trial's result")
        return refs[0]


_TARGETS: dict[str, TuneTarget] = {}


def register_target(target: TuneTarget) -> TuneTarget:
    """Make `target` tunable by name (re-registering replaces)."""
    _TARGETS[target.op] = target
    return target


def get_target(op: str) -> TuneTarget:
    if op not in _TARGETS:
        raise KeyError(f"no tuning target for op {op!r}; known: {', '.join(sorted(_TARGETS)) or 'none'}")
    return _TARGETS[op]


def targets() -> dict[str, TuneTarget]:
    return dict(_TARGETS)


def space_size(space: Mapping[str, Sequence]) -> int:
    """Number of configs in a product space (1 for an empty space: just the default)."""
    n = 1
    for values in space.values():
        n *= max(1, len(values))
    return n


def product(axes: Mapping[str, Sequence]) -> list[dict]:
    """Every combination of `axes` (key → values) as dicts, in axis order."""
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def filter_buckets(buckets: list[dict], only: Mapping[str, Sequence[str]] | None) -> list[dict]:
    """Keep buckets whose value of each key in `only` is one of the given values (compared as text)."""
    if not only:
        return buckets
    for key in only:
        if buckets and key not in buckets[0]:
            raise ValueError(f"--only {key}=...: buckets have no key {key!r}; keys: {', '.join(buckets[0])}")
    kept = [b for b in buckets if all(str(b[k]) in {str(v) for v in vals} for k, vals in only.items())]
    if buckets and not kept:
        have = "; ".join(f"{k}: {', '.join(sorted({str(b[k]) for b in buckets}, key=_natural))}" for k in only)
        given = " ".join(k + "=" + ",".join(v) for k, v in only.items())
        raise ValueError(f"--only {given} matches none of the "
                         f"{len(buckets)} buckets; the buckets have {have}")
    return kept


def _natural(text: str):
    """Sort key: numbers by value, then text."""
    return (0, float(text), "") if text.replace(".", "", 1).isdigit() else (1, 0.0, text)
