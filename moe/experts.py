"""The `moe_experts` op: gate_up → SiLU·mul → down for every local expert, on a dispatch layout.

    run_experts(layout, weights, *, runner=None, config=None, expected_m=None, active_experts=None)
        -> same layout, bf16

A runner is a backend of op "moe_experts" (one file each under `moe/runners/`) that declares the
layouts and payloads it accepts in its registry options::

    options={"layouts": ("contiguous", "masked"), "payloads": ("bf16", "nvfp4"), "weights": ("nvfp4",)}

The layout's contract is checked at this boundary under the op name `moe_experts` and the runner's
name, so a 2-D (normal-dispatch) hidden handed to a masked-only runner raises ShapeError with the
hint to change dispatch mode or runner. `check_pairing` rejects impossible dispatch/runner pairs when
a layer is built.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from pdlab.kernels import registry
from pdlab.kernels.env import ENV
from pdlab.kernels.graphs import capturing
from pdlab.kernels.contracts import Op, ShapeError, Spec, describe_tensor
from pdlab.kernels.tuned import register_bucket_upgrade, resolve_config
from pdlab.moe.layouts import Contiguous, Layout, Masked, layout_op, with_hidden
from pdlab.moe.weights import ExpertWeights

OP = "moe_experts"

WEIGHTS = Op(
    OP,
    inputs={"w13_weight": Spec("E 2*I K/2", "uint8"), "w2_weight": Spec("E K I/2", "uint8"),
            "w13": Spec("E 2*I K", "bf16|fp16|fp32"), "w2": Spec("E K I", "bf16|fp16|fp32")},
    hints={k: "the experts' weights must match the layout: E local experts and hidden size K."
           for k in ("w13_weight", "w2_weight", "w13", "w2")},
)


def runner_options(runner: str) -> Mapping[str, Any]:
    """The accepted layouts / payloads / weight forms a runner declares."""
    return registry.get_backend(OP, runner).options


def check_pairing(dispatch_layout: str, payload: str, runner: str) -> None:
    """Raise ValueError (naming both sides and the fix) if `runner` cannot consume what a dispatcher
    produces: dispatch_layout "contiguous" (normal mode) | "masked" (low-latency), payload
    "bf16" | "fp8" | "nvfp4". Returns None when the pairing works."""
    opts = runner_options(runner)
    layouts, payloads = tuple(opts.get("layouts", ())), tuple(opts.get("payloads", ()))
    problems = []
    if dispatch_layout not in layouts:
        mode = {"contiguous": "normal", "masked": "low_latency"}
        problems.append(f"layout {dispatch_layout!r} (mode={mode.get(dispatch_layout, '?')!r})")
    if payload not in payloads:
        problems.append(f"payload {payload!r}")
    if not problems:
        return
    fits = [b.name for b in registry.backends(OP)
            if dispatch_layout in b.options.get("layouts", ()) and payload in b.options.get("payloads", ())]
    alt_modes = ", ".join(f"mode={'normal' if l == 'contiguous' else 'low_latency'!r}" for l in layouts)
    raise ValueError(
        f"dispatch produces {' and '.join(problems)}, but expert runner {runner!r} accepts layouts "
        f"{layouts} with payloads {payloads}. Fix: use a dispatch mode/payload it accepts ({alt_modes}; "
        f"payload one of {payloads}), or a runner that accepts {dispatch_layout}/{payload}: "
        f"{', '.join(fits) or 'none registered'}.")


def size_problem(runner: registry.Backend, weights: ExpertWeights) -> str | None:
    """Why `runner` cannot run experts of these sizes (its `size_problem` option), else None."""
    fn = runner.options.get("size_problem")
    return fn(weights.hidden_size, weights.intermediate_size) if fn is not None else None


def select_runner(layout: Layout, weights: ExpertWeights, runner: str | None = None) -> registry.Backend:
    """The runner to use: `runner` by name (error if unusable here), else the most preferred usable one
    accepting this layout kind, payload and weight form."""
    device = layout.hidden.device
    if runner is not None:
        if device.type == "cpu" and registry.get_backend(OP, runner).options.get("interpretable") and _interpreting():
            return registry.get_backend(OP, runner)
        return registry.select(OP, runner, device=device)

    def accept(b: registry.Backend) -> bool:
        o = b.options
        forms = o.get("weights", ("bf16", "nvfp4"))
        return (layout.kind in o.get("layouts", ()) and layout.payload in o.get("payloads", ())
                and ((weights.has_nvfp4 and "nvfp4" in forms) or (weights.has_bf16 and "bf16" in forms))
                and size_problem(b, weights) is None)

    return registry.select(OP, device=device, accept=accept)


def run_experts(layout: Layout, weights: ExpertWeights, *, runner: str | None = None,
                config: Mapping[str, Any] | None = None, expected_m: int | None = None,
                active_experts: int | None = None) -> Layout:
    """Run every local expert on its rows: out = down(silu(x·gateᵀ) · (x·upᵀ)).

    Args:
        layout: Contiguous (hidden [N, K] | fp8 [N, K] | nvfp4 [N, K/2], counts [E], offsets [E+1]) or
            Masked (hidden [E, M, K(/2)], masked_m [E]); see pdlab.moe.layouts for payload tensors.
        weights: ExpertWeights with E experts, hidden K, intermediate I (bf16 and/or NVFP4).
        runner: "torch" | "torch_grouped" | "triton" | "cutedsl" | None (best usable for this input).
        config: explicit runner config (wins over tuned ones).
        expected_m: tokens per expert the caller expects (shape bucket for tuned configs; default
            N/E for contiguous, M for masked).
        active_experts: experts the caller expects to hold tokens (shape bucket too: one token on 8 of 256
            experts reads 1/32 of the weights that one token on each does); default min(E, N) for contiguous,
            E for masked (the host cannot see masked_m without a sync).
    Returns:
        the same layout kind with hidden [N, K] / [E, M, K] bf16 (fp16/fp32 when the input was),
        payload "bf16"; rows past the valid ones (masked rows >= masked_m) are unspecified.
    Raises:
        ShapeError when the layout does not fit the runner's contract (wrong layout kind, shapes,
        dtypes, or weights of another size), for expert sizes the runner cannot take (triton: hidden and
        intermediate sizes multiples of 32), and for row counts beyond the slab or the layout's bound
        (`check_rows`: the torch runner always, the others under PDLAB_CHECK_INVARIANTS=1); ValueError for an
        unsupported payload, and for expected_m / active_experts that are not integers >= 1.
    """
    if not isinstance(layout, (Contiguous, Masked)):
        raise ShapeError(OP, runner, "layout", "must be a Contiguous or Masked layout object", "Contiguous | Masked",
                         describe_tensor(layout), "build it with pdlab.moe.layouts.group_tokens / to_masked, "
                         "or take it from dispatch().")
    backend = registry.get_backend(OP, runner) if runner is not None else select_runner(layout, weights)
    opts = backend.options
    if layout.kind not in opts.get("layouts", ()):
        other = opts["layouts"][0]
        op = layout_op(other, layout.payload, OP)
        op.check(backend.name, **({"masked_m": layout.counts} if other == "masked" else {}), hidden=layout.hidden)
        raise ShapeError(OP, backend.name, "layout", f"is {layout.kind}, which this runner does not accept",
                         f"{other} layout", describe_tensor(layout.hidden), op.hints["hidden"]("dims", None, {}))
    if layout.payload not in opts.get("payloads", ()):
        raise ValueError(f"{OP}[{backend.name}] does not accept the {layout.payload!r} payload (accepts "
                         f"{opts.get('payloads')}); quantize differently at dispatch or pick another runner")
    dims = layout.validate(OP, backend.name)
    E, K = dims["E"], dims["K"]
    wt = ({"w13_weight": weights.w13_weight, "w2_weight": weights.w2_weight} if weights.has_nvfp4 else {})
    if weights.has_bf16:
        wt.update(w13=weights.w13, w2=weights.w2)
    wdims = WEIGHTS.check(backend.name, bound={"E": E, "K": K}, **wt)
    why = size_problem(backend, weights)
    if why:
        raise ShapeError(OP, backend.name, "weights", why, "sizes this runner takes",
                         f"hidden_size={K}, moe_intermediate_size={wdims['I']}",
                         "run these experts with runner 'torch_grouped' (bf16) or 'torch' (the reference)")
    expected_m, active_experts = _expected(layout, E, expected_m, active_experts)
    if runner is not None:
        backend = select_runner(layout, weights, runner)  # availability, after the shape checks
    cfg = _config(backend, layout, wdims["I"], expected_m, active_experts, config)
    if ENV.check_invariants and not backend.reference and not capturing():
        layout.check_rows(OP, backend.name)  # one sync; the torch reference checks its rows itself
    out = backend.impl(layout, weights, config=cfg)
    return with_hidden(layout, out)


def bucket(layout: Layout, intermediate: int, expected_m: int, active_experts: int | None = None
           ) -> dict[str, int | str]:
    """Shape bucket for tuned-config lookup (`active_experts` defaults to every local expert)."""
    E = layout.num_experts
    return {"layout": layout.kind, "payload": layout.payload, "experts": E, "hidden": layout.hidden_size,
            "intermediate": intermediate, "tokens_per_expert": int(expected_m),
            "active_experts": int(E if active_experts is None else active_experts)}


def upgrade_bucket(stored: dict) -> dict:
    """A stored bucket as the op keys it now: entries written before `active_experts` was a key were all
    measured with every local expert holding tokens."""
    if "active_experts" not in stored and "experts" in stored:
        stored = {**stored, "active_experts": stored["experts"]}
    return stored


register_bucket_upgrade(OP, upgrade_bucket)


def resolved_config(layout: Layout, weights: ExpertWeights, runner: str, config: Mapping[str, Any] | None = None,
                    expected_m: int | None = None, active_experts: int | None = None) -> tuple[dict[str, Any], str]:
    """(the config `run_experts(layout, weights, runner=runner, config=config, expected_m=expected_m,
    active_experts=active_experts)` hands the runner: explicit > tuned > default, plus "_expected_m"; where it
    came from: "explicit", "tuned:<file>", "default"), without running it."""
    backend = registry.get_backend(OP, runner)
    expected_m, active_experts = _expected(layout, layout.num_experts, expected_m, active_experts)
    return _config(backend, layout, weights.intermediate_size, expected_m, active_experts, config, with_source=True)


def launch_key(layout: Layout, weights: ExpertWeights, runner: str, config: Mapping[str, Any] | None = None,
               expected_m: int | None = None, active_experts: int | None = None) -> tuple:
    """What decides the kernels `run_experts(layout, weights, runner=runner, config=config, expected_m=...,
    active_experts=...)` compiles and launches, as a hashable value: equal keys launch the same kernels (other sizes,
    same code). The runner's own `launch_key` option where it has one (its config resolved at this expected_m), else
    the config it would get (without "_expected_m"). Reads no tensor: `layout` only gives the kind, payload, sizes
    and device (a warm-up passes an empty one). Used to warm up every kernel the token counts of a serving range
    reach."""
    backend = registry.get_backend(OP, runner)
    cfg, _ = resolved_config(layout, weights, runner, config=config, expected_m=expected_m,
                             active_experts=active_experts)
    fn = backend.options.get("launch_key")
    if fn is not None:
        return (runner, fn(layout, weights, cfg))
    return (runner, tuple(sorted((k, repr(v)) for k, v in cfg.items() if k != "_expected_m")))


def _expected(layout: Layout, num_experts: int, expected_m: int | None, active_experts: int | None
              ) -> tuple[int, int]:
    """(tokens per expert, experts holding tokens) the call's bucket names. Not given: rows over experts and
    min(experts, rows) for contiguous rows, the slab's rows and every expert for a masked slab."""
    for name, hint in (("expected_m", expected_m), ("active_experts", active_experts)):
        if hint is not None and (type(hint) is not int or hint < 1):
            _check_hint(name, hint)
    rows = layout.hidden.shape[0] if layout.kind == "contiguous" else None
    if expected_m is None:
        expected_m = max(1, rows // max(num_experts, 1)) if rows is not None else layout.hidden.shape[1]
    if active_experts is None:
        active_experts = min(num_experts, rows) if rows is not None else num_experts
    return int(expected_m), max(1, min(int(active_experts), num_experts))


def _check_hint(name: str, hint: Any) -> None:
    """ValueError unless the size hint is an integer >= 1 (numpy and torch integers pass; bool does not)."""
    try:
        ok = not isinstance(hint, bool) and operator.index(hint) >= 1
    except TypeError:  # not an integer at all
        ok = False
    if ok:
        return
    what = "tokens per expert" if name == "expected_m" else "experts holding tokens"
    raise ValueError(f"{OP}: {name}={hint!r} must be an integer >= 1 (the {what} the caller expects), or None "
                     "for the layout's own count")


def _config(backend: registry.Backend, layout: Layout, intermediate: int, expected_m: int, active_experts: int,
            explicit: Mapping[str, Any] | None, with_source: bool = False):
    """The runner's config (and, with_source, where it came from)."""
    source = "explicit" if explicit else "default"
    if not backend.config_space and not backend.default_config:
        if explicit:  # a runner without knobs would ignore them: say so, as the lookup does for unknown keys
            raise ValueError(f"{OP}[{backend.name}]: unknown config keys {sorted(explicit)}; known: [] (this runner "
                             "has no knobs: pass config=None or {}, or name a runner that takes them, e.g. triton)")
        cfg = {}
    else:
        cfg, source = resolve_config(OP, backend.name, bucket(layout, intermediate, expected_m, active_experts),
                                     device=layout.hidden.device, explicit=explicit)
        cfg["_expected_m"] = int(expected_m)
    return (cfg, source) if with_source else cfg


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _register_runners() -> None:
    import pdlab.moe.runners  # noqa: F401  (each runner file registers itself)


_register_runners()
