"""Shape-checked op contracts.

An op declares its tensors once as symbolic specs; every backend of the op is checked against the
same declaration at the op boundary (eager calls and graph capture, never inside a replay)::

    MLA_DECODE = Op(
        "mla_decode",
        inputs={
            "q": Spec("B Sq H 576", "bf16|fp16|fp32"),
            "kv_cache": Spec("P page 576", "bf16|fp16|fp32|uint8|fp8_e4m3"),
            "block_table": Spec("B pages", "int32"),
            "seqlens": Spec("B", "int32"),
        },
        outputs={"out": Spec("B Sq H 512", "bf16|fp16|fp32"), "lse": Spec("B H Sq", "fp32")},
    )
    dims = MLA_DECODE.check("triton", q=q, kv_cache=kv, block_table=bt, seqlens=sl)
    dims["B"], dims["page"]

Dimension tokens: a name (`E`, `K`), a literal (`576`), or a name scaled by literals (`K/2`, `K/16`,
`2*I`, `2*I/16`). A name binds to the first size seen and every later use must agree; `K/2` binds
`K` when `K` is still free. `*` as a token matches any size without binding. `...` as the first token
matches any number of leading dims.

A violation raises :class:`ShapeError` (a ValueError) naming the op, backend, argument, the expected
shape with the sizes bound so far, what was received, and the op's hint for that argument.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

# ---------------------------------------------------------------------------------------------
# dtypes

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_ALIASES["fp8_e4m3"] = torch.float8_e4m3fn
if hasattr(torch, "float8_e5m2"):
    _DTYPE_ALIASES["fp8_e5m2"] = torch.float8_e5m2
if hasattr(torch, "float4_e2m1fn_x2"):
    _DTYPE_ALIASES["fp4x2"] = torch.float4_e2m1fn_x2

_DTYPE_NAMES = {v: k for k, v in _DTYPE_ALIASES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a torch dtype as used in specs and messages (bf16, fp8_e4m3, int32, ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtypes(text: str | torch.dtype | tuple | None) -> frozenset[torch.dtype] | None:
    """`"bf16|fp16"` → frozenset of torch dtypes; None means any dtype. Unknown names (fp8 on an
    old torch) are dropped, so a spec never fails to import."""
    if text is None:
        return None
    if isinstance(text, torch.dtype):
        return frozenset([text])
    if isinstance(text, (tuple, list, set, frozenset)):
        out: set[torch.dtype] = set()
        for t in text:
            out |= parse_dtypes(t) or set()
        return frozenset(out)
    out = set()
    for name in text.split("|"):
        name = name.strip()
        if name in _DTYPE_ALIASES:
            out.add(_DTYPE_ALIASES[name])
        elif not name.startswith(("fp8", "fp4")):
            raise ValueError(f"unknown dtype {name!r} in spec; known: {', '.join(_DTYPE_ALIASES)}")
    return frozenset(out)


# ---------------------------------------------------------------------------------------------
# dims

_DIM_RE = re.compile(r"^(?:(\d+)\*)?([A-Za-z_][A-Za-z0-9_]*)(?:\*(\d+))?(?:/(\d+))?$")


@dataclass(frozen=True)
class Dim:
    """One dimension token: `literal`, or `name * mul / div`, or `*` (any)."""

    text: str
    name: str | None = None
    literal: int | None = None
    mul: int = 1
    div: int = 1

    @staticmethod
    def parse(token: str) -> "Dim":
        if token == "*":
            return Dim("*")
        if token.isdigit():
            return Dim(token, literal=int(token))
        m = _DIM_RE.match(token)
        if not m:
            raise ValueError(f"bad dimension token {token!r} (use NAME, 123, NAME/2, 2*NAME or *)")
        pre, name, post, div = m.groups()
        mul = int(pre or 1) * int(post or 1)
        return Dim(token, name=name, mul=mul, div=int(div or 1))

    def expected(self, bound: Mapping[str, int]) -> int | None:
        if self.literal is not None:
            return self.literal
        if self.name is not None and self.name in bound:
            value = bound[self.name] * self.mul
            return value // self.div if value % self.div == 0 else None
        return None

    def render(self, bound: Mapping[str, int]) -> str:
        if self.literal is not None or self.name is None:
            return self.text
        if self.name in bound:
            exp = self.expected(bound)
            return f"{self.text}={exp}" if exp is not None else f"{self.text}=?"
        return self.text


class ShapeError(ValueError):
    """A tensor handed to an op does not fit the op's contract.

    Attributes: op, backend, argument, expected (rendered spec), actual (rendered tensor), hint."""

    def __init__(self, op: str, backend: str | None, argument: str, problem: str, expected: str,
                 actual: str, hint: str | None = None):
        self.op, self.backend, self.argument = op, backend, argument
        self.problem, self.expected, self.actual, self.hint = problem, expected, actual, hint
        where = f"{op}[{backend}]" if backend else op
        msg = f"{where} argument '{argument}' {problem}: expects {expected} but got {actual}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


def is_scale(value: object, zero_ok: bool = False) -> bool:
    """Whether a host value is a usable scale: a real number (not a bool), finite and > 0 (>= 0 with zero_ok). The
    ops check host numbers with it for free; a tensor's value is not read here (that would be a device sync)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(float(value)):
        return False
    return float(value) >= 0 if zero_ok else float(value) > 0


def describe_tensor(t: object) -> str:
    """`[4096, 7168] bf16 cuda:0` for a tensor, the type name for anything else."""
    if isinstance(t, torch.Tensor):
        dims = ", ".join(str(s) for s in t.shape)
        return f"[{dims}] {dtype_name(t.dtype)} {t.device}"
    return f"{type(t).__name__} {t!r:.60}"


@dataclass(frozen=True)
class Spec:
    """Symbolic description of one tensor argument.

    shape: space-separated dim tokens, e.g. "E M K/2".
    dtypes: "bf16|fp16", a torch dtype, or None for any.
    layout: a tag shown in messages, e.g. "masked" or "contiguous".
    contiguous: the whole tensor must be contiguous; last_dim_contiguous: stride(-1) == 1.
    optional: None is accepted for this argument.
    same_device: the tensor must sit on the device of the other tensors of the call.
    """

    shape: str
    dtypes: str | torch.dtype | tuple | None = None
    layout: str | None = None
    contiguous: bool = False
    last_dim_contiguous: bool = False
    optional: bool = False
    same_device: bool = True
    dims: tuple[Dim, ...] = field(init=False, repr=False, compare=False)
    ellipsis: bool = field(init=False, repr=False, compare=False)
    allowed: frozenset | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = self.shape.split()
        ellipsis = bool(tokens) and tokens[0] == "..."
        if ellipsis:
            tokens = tokens[1:]
        object.__setattr__(self, "ellipsis", ellipsis)
        object.__setattr__(self, "dims", tuple(Dim.parse(t) for t in tokens))
        object.__setattr__(self, "allowed", parse_dtypes(self.dtypes))

    def render(self, bound: Mapping[str, int]) -> str:
        inner = ", ".join(d.render(bound) for d in self.dims)
        if self.ellipsis:
            inner = "..., " + inner if inner else "..."
        text = f"[{inner}]"
        if self.allowed is not None:
            text += " " + "|".join(sorted(dtype_name(d) for d in self.allowed))
        if self.layout:
            text += f" ({self.layout} layout)"
        return text


Hint = str | Callable[[str, object, Mapping[str, int]], str | None]


class Op:
    """An op's contract: named input and output specs, plus hints shown on violation.

    hints: argument name → text, or a callable (problem, value, bound dims) → text or None.
    """

    def __init__(self, name: str, inputs: Mapping[str, Spec], outputs: Mapping[str, Spec] | None = None,
                 hints: Mapping[str, Hint] | None = None, doc: str = ""):
        self.name = name
        self.inputs = dict(inputs)
        self.outputs = dict(outputs or {})
        self.hints = dict(hints or {})
        self.doc = doc
        overlap = set(self.inputs) & set(self.outputs)
        if overlap:
            raise ValueError(f"op {name}: names used for both inputs and outputs: {sorted(overlap)}")

    def __repr__(self) -> str:
        return f"Op({self.name!r})"

    def check(self, backend: str | None = None, bound: Mapping[str, int] | None = None,
              **tensors: object) -> dict[str, int]:
        """Check the given tensors (inputs and/or outputs, by name) against the contract.

        Returns the bound dims (name → size). `bound` pre-binds dims (e.g. {"page": 64}).
        Raises ShapeError on the first violation, naming the argument."""
        dims: dict[str, int] = dict(bound) if bound else {}
        device = None
        for arg, value in tensors.items():
            spec = self.inputs.get(arg) or self.outputs.get(arg)
            if spec is None:
                raise TypeError(f"{self.name}: no argument named {arg!r} in its contract "
                                f"(inputs: {', '.join(self.inputs)}; outputs: {', '.join(self.outputs)})")
            if value is None:
                if spec.optional:
                    continue
                self._fail(backend, arg, "is required", spec, dims, value)
            if not isinstance(value, torch.Tensor):
                self._fail(backend, arg, "must be a torch.Tensor", spec, dims, value)
            if spec.allowed is not None and value.dtype not in spec.allowed:
                self._fail(backend, arg, "has the wrong dtype", spec, dims, value)
            shape = value.shape
            n = len(spec.dims)
            if (len(shape) < n) if spec.ellipsis else (len(shape) != n):
                self._fail(backend, arg, f"has {len(shape)} dims instead of {'at least ' if spec.ellipsis else ''}{n}",
                           spec, dims, value)
            offset = len(shape) - n
            for i, dim in enumerate(spec.dims):
                size = shape[offset + i]
                if dim.literal is not None:
                    if size != dim.literal:
                        self._fail(backend, arg, f"has size {size} at dim {offset + i} where {dim.literal} is required",
                                   spec, dims, value)
                elif dim.name is not None:
                    have = dims.get(dim.name)
                    if have is None:
                        scaled = size * dim.div
                        if scaled % dim.mul:
                            self._fail(backend, arg, f"has size {size} at dim {offset + i}, which is not "
                                       f"{dim.text} for any whole {dim.name}", spec, dims, value)
                        dims[dim.name] = scaled // dim.mul
                    else:
                        want = have * dim.mul
                        if want % dim.div or want // dim.div != size:
                            self._fail(backend, arg, f"has size {size} at dim {offset + i} where "
                                       f"{dim.text}={want / dim.div:g} (bound {dim.name}={have})",
                                       spec, dims, value)
            if spec.same_device:
                if device is None:
                    device = value.device
                elif value.device != device:  # with one tensor before it, that one may be the odd one: name it
                    before = self._device_args_before(arg, tensors)
                    others = f"{before[0]!r} is" if len(before) == 1 else "the other tensors are"
                    self._fail(backend, arg, f"is on {value.device} while {others} on {device}", spec, dims, value)
            if spec.contiguous and not value.is_contiguous():
                self._fail(backend, arg, "must be contiguous (call .contiguous())", spec, dims, value)
            if spec.last_dim_contiguous and value.dim() and value.stride(-1) != 1:
                self._fail(backend, arg, "must have a contiguous last dim (stride(-1) == 1)", spec, dims, value)
        return dims

    def _device_args_before(self, arg: str, tensors: Mapping[str, object]) -> list[str]:
        """The tensors checked for their device before `arg` (for a failure's message: kept off the check's path)."""
        names = list(tensors)
        return [a for a in names[:names.index(arg)] if tensors[a] is not None
                and (self.inputs.get(a) or self.outputs.get(a)).same_device]

    def _fail(self, backend: str | None, arg: str, problem: str, spec: Spec, dims: Mapping[str, int],
              value: object) -> None:
        hint = self.hints.get(arg)
        if callable(hint):
            hint = hint(problem, value, dims)
        raise ShapeError(self.name, backend, arg, problem, spec.render(dims), describe_tensor(value), hint)

    def require(self, backend: str | None, condition: bool, arg: str, problem: str, value: object,
                expected: str, hint: str | None = None) -> None:
        """Raise a ShapeError for a value constraint the specs cannot state (e.g. max(seqlens) beyond
        the pages given). Only for checks that need no device sync."""
        if not condition:
            raise ShapeError(self.name, backend, arg, problem, expected, describe_tensor(value),
                             hint or (self.hints.get(arg) if isinstance(self.hints.get(arg), str) else None))
