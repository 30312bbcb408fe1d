"""MLA attention ops: contracts, backend selection and the public functions.

Three ops share the paged latent cache [num_pages, page_size, 576] (c_kv 512 | k_pe 64 per token,
bf16/fp16/fp32, or uint8 holding fp8_e4m3 bytes with a per-tensor `kv_scale`):

- `mla_decode`: S_q new tokens per sequence (1, or 2/4 with speculative decoding), absorbed queries.
- `mla_prefill`: ragged extend/prefill in the same absorbed formulation (see docs/attention.md).
- `store_kv`: write this step's latent rows into their slots (fp8 quantization on uint8 pools).

Each public function checks its tensors against the op contract (cheap: shapes, dtypes, strides and
host-known values only, no device sync), picks a backend from the registry (the most preferred one
that runs here and supports the page size / kv dtype / S_q, or the one named), resolves its config
(explicit > tuned > default) and calls it.
"""

from __future__ import annotations

import math
import numbers
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch

from pdlab.kernels import registry, tuned
from pdlab.kernels.contracts import Op, ShapeError, Spec, dtype_name, is_scale
from pdlab.kernels.env import ENV
from pdlab.kernels.graphs import capturing
from pdlab.kernels.registry import Backend

HEAD_DIM = 576  # kv_lora_rank 512 + rope 64
V_DIM = 512
PAGE_SIZES = tuple(1 << i for i in range(8))  # 1 .. 128

# ---------------------------------------------------------------------------------------------
# hints


def _hint(shape: str, dtype: str, width: str | None = None):
    """A contract hint: `width` when the 576-wide last dim is wrong, `dtype` for a dtype problem,
    else `shape` (the argument's expected layout)."""
    def hint(problem: str, value: object, dims: Mapping[str, int]) -> str:
        if width and "576 is required" in problem:
            return width
        return dtype if "dtype" in problem else shape
    return hint


_q_hint = _hint("Decode q is [batch, q_len, heads, 576]; prefill q is [new_tokens, heads, 576].",
                "Cast q to bf16 (or fp16/fp32 for reference checks).",
                "MLA ops take absorbed queries: per head [q_nope·W_UK (512) | q_pe (64)] = 576 values; "
                "multiply q_nope (128) by W_UK before the call.")
_kv_hint = _hint("The latent cache is [num_pages, page_size, 576] (one pool per layer).",
                 "Pools are bf16/fp16/fp32, or uint8 holding fp8_e4m3 bytes (pass kv_scale).",
                 "Each cache row is one token's latent [c_kv (512) | k_pe (64)] = 576 values.")
_table_hint = _hint("block_table is [batch, max_pages]: one row of page ids per sequence.",
                    "Block tables are int32: pass block_table.to(torch.int32).")
_seqlens_hint = _hint("seqlens is [batch]: total tokens of each sequence including this step's new ones.",
                      "seqlens are int32: pass seqlens.to(torch.int32).")
_indptr_hint = _hint("qo_indptr is [batch + 1]: cumulative new-token counts, qo_indptr[0] = 0, qo_indptr[-1] = T.",
                     "qo_indptr is int32: pass qo_indptr.to(torch.int32).")
_slots_hint = _hint("slots is [num_tokens], one slot per latent row.",
                    "slots are int64 (page * page_size + offset; -1 skips a row): pass slots.to(torch.int64).")


# ---------------------------------------------------------------------------------------------
# contracts

_FLOAT = "bf16|fp16|fp32"
_POOL = "bf16|fp16|fp32|uint8|fp8_e4m3"

MLA_DECODE = Op(
    "mla_decode",
    inputs={
        "q": Spec("B Sq H 576", _FLOAT, last_dim_contiguous=True),
        "kv_cache": Spec("P page 576", _POOL, last_dim_contiguous=True),
        "block_table": Spec("B pages", "int32", last_dim_contiguous=True),
        "seqlens": Spec("B", "int32", contiguous=True),
    },
    outputs={"out": Spec("B Sq H 512", _FLOAT), "lse": Spec("B H Sq", "fp32")},
    hints={"q": _q_hint, "kv_cache": _kv_hint, "block_table": _table_hint, "seqlens": _seqlens_hint},
    doc="absorbed MLA decode over a paged latent cache; S_q tokens per sequence, causal among them",
)

MLA_PREFILL = Op(
    "mla_prefill",
    inputs={
        "q": Spec("T H 576", _FLOAT, last_dim_contiguous=True),
        "kv_cache": Spec("P page 576", _POOL, last_dim_contiguous=True),
        "block_table": Spec("B pages", "int32", last_dim_contiguous=True),
        "seqlens": Spec("B", "int32", contiguous=True),
        "qo_indptr": Spec("B1", "int32", contiguous=True),
    },
    outputs={"out": Spec("T H 512", _FLOAT), "lse": Spec("T H", "fp32")},
    hints={"q": _q_hint, "kv_cache": _kv_hint, "block_table": _table_hint, "seqlens": _seqlens_hint,
           "qo_indptr": _indptr_hint},
    doc="absorbed MLA extend/prefill: ragged new tokens attend causally to themselves and the cached prefix",
)

STORE_KV = Op(
    "store_kv",
    inputs={
        "kv_cache": Spec("P page 576", _POOL, last_dim_contiguous=True),
        "slots": Spec("T", "int64", contiguous=True),
        "latent": Spec("T 576", _FLOAT, last_dim_contiguous=True),
    },
    hints={"kv_cache": _kv_hint, "slots": _slots_hint,
           "latent": "latent rows are [num_tokens, 576] = [c_kv (512) | k_pe (64)] after the kv norm and rope."},
    doc="scatter latent rows into the paged cache by slot (fp8 quantization for uint8 pools)",
)

OPS = {op.name: op for op in (MLA_DECODE, MLA_PREFILL, STORE_KV)}

# ---------------------------------------------------------------------------------------------
# public functions


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
               softmax_scale: float, *, kv_scale: float | torch.Tensor | None = None,
               backend: str | Backend | None = None, config: Mapping[str, Any] | None = None,
               max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache.

    Args:
        q: [B, S_q, H, 576] bf16 | fp16 | fp32, last dim contiguous: [q_nope·W_UK (512) | q_pe (64)].
        kv_cache: [P, page_size, 576] bf16 | fp16 | fp32, or uint8 (fp8_e4m3 bytes; value = e4m3 * kv_scale).
            page_size a power of two 1..128. Rows at positions >= seqlens[b] are never read.
        block_table: [B, max_pages] int32, page ids of each sequence in order.
        seqlens: [B] int32, tokens per sequence including the S_q new ones (already stored).
            Query i of S_q sees positions < seqlens[b] - S_q + i + 1.
        softmax_scale: float, e.g. 1/sqrt(192) (times YaRN mscale²).
        kv_scale: per-tensor fp8 dequant scale (float or 1-element fp32 tensor); only for uint8 pools.
        backend: registry name (or a Backend object) to force; default: best usable here.
        config: backend knobs merged over the backend default (an empty dict: the default itself); None: the
            tuned entry for this shape, else the default.
        max_seqlen: optional host-known bound of seqlens, checked against the pages given.
    Returns:
        out: [B, S_q, H, 512] q.dtype; lse: [B, H, S_q] fp32 (natural log of the softmax denominator).
    Graph-safe for the triton backend (no host sync, no host-dependent shapes); flashinfer (which plans on the host)
    inside `replayed_graph_capture(seqlens)`, whose `replan` re-plans it before each replay."""
    dims = MLA_DECODE.check(backend_name(backend), q=q, kv_cache=kv_cache, block_table=block_table,
                            seqlens=seqlens)
    _check_pool(MLA_DECODE, backend, kv_cache, kv_scale, dims, block_table, seqlens, max_seqlen)
    softmax_scale = _softmax_scale(MLA_DECODE, backend, softmax_scale)
    kv_cache = _as_bytes(kv_cache)
    bucket = {"batch": dims["B"], "seqlen": dims["pages"] * dims["page"], "heads": dims["H"],
              "kv_dtype": kv_dtype_name(kv_cache), "q_len": dims["Sq"]}
    b = _select(MLA_DECODE, backend, q, kv_cache, q_len=dims["Sq"], bucket=bucket)
    cfg, source = resolve_config(MLA_DECODE.name, b, bucket, q.device, config)
    if source.startswith("tuned") and cfg.get("kernel") == "gluon":
        # a tuned entry is its nearest bucket's: "auto" runs the Gluon kernel wherever "gluon" could and, where this
        # problem has more query rows than that kernel holds (S_q 4 at 16 heads), the Triton one instead of failing
        cfg["kernel"] = "auto"
    return b.impl(q, kv_cache, block_table, seqlens, softmax_scale, kv_scale=kv_scale, config=cfg)


def _host_readable(t: torch.Tensor) -> bool:
    """Whether the op may read `t`'s values on the host to check them: always on the CPU; a GPU tensor only under
    PDLAB_CHECK_INVARIANTS=1 (one host sync) and never while a CUDA graph is captured."""
    return t.device.type == "cpu" or (ENV.check_invariants and not capturing())


def mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor,
                qo_indptr: torch.Tensor, softmax_scale: float, *, kv_scale: float | torch.Tensor | None = None,
                max_q_len: int | None = None, backend: str | Backend | None = None,
                config: Mapping[str, Any] | None = None,
                max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA extend/prefill over the paged latent cache (ragged batch).

    Args:
        q: [T, H, 576] bf16 | fp16 | fp32, absorbed queries of all new tokens, sequence after sequence.
        kv_cache: [P, page_size, 576] as in `mla_decode`; the new tokens' rows are already stored.
        block_table: [B, max_pages] int32.
        seqlens: [B] int32, total tokens per sequence including its new ones.
        qo_indptr: [B + 1] int32, cumulative new-token counts (qo_indptr[-1] = T). New token j of
            sequence b sits at position seqlens[b] - n_b + j and sees positions <= its own.
        softmax_scale: float.
        kv_scale: fp8 dequant scale for uint8 pools.
        max_q_len: host-known max new tokens of one sequence (sizes the launch grid; default T). Checked against
            a host qo_indptr; with qo_indptr on the GPU (not read: no sync) a smaller value leaves the new tokens
            past it unwritten.
        backend, config, max_seqlen: as in `mla_decode`.
    Returns:
        out: [T, H, 512] q.dtype; lse: [T, H] fp32 (natural log).
    Graph-safe for the triton backend."""
    dims = MLA_PREFILL.check(backend_name(backend), q=q, kv_cache=kv_cache, block_table=block_table,
                             seqlens=seqlens, qo_indptr=qo_indptr)
    MLA_PREFILL.require(backend_name(backend), dims["B1"] == dims["B"] + 1, "qo_indptr", "has the wrong length",
                        qo_indptr, f"[B + 1 = {dims['B'] + 1}] int32", _indptr_hint("", None, dims))
    if max_q_len is not None:
        MLA_PREFILL.require(backend_name(backend), 0 < int(max_q_len) <= max(dims["T"], 1), "max_q_len",
                            f"is {max_q_len}, outside 1..T", q, f"1 <= max_q_len <= T={dims['T']}",
                            "max_q_len bounds the new tokens of one sequence; pass None to use T.")
    if _host_readable(qo_indptr) and dims["B"] > 0:  # host-known: check for free (GPU: PDLAB_CHECK_INVARIANTS=1)
        ip = qo_indptr.tolist()
        MLA_PREFILL.require(backend_name(backend), ip[0] == 0 and ip[-1] == dims["T"] and
                            all(a <= c for a, c in zip(ip, ip[1:])), "qo_indptr", f"is not a valid indptr ({ip})",
                            qo_indptr, f"0 = indptr[0] <= ... <= indptr[-1] = T = {dims['T']}")
        if max_q_len is not None:  # it sizes the launch grid: rows past it would be left unwritten
            news = [c - a for a, c in zip(ip, ip[1:])]
            top = max(range(len(news)), key=news.__getitem__)
            MLA_PREFILL.require(backend_name(backend), news[top] <= int(max_q_len), "max_q_len",
                                f"is {max_q_len}, but sequence {top} adds {news[top]} new tokens", qo_indptr,
                                f"max_q_len >= {news[top]} (the most new tokens of one sequence)",
                                "max_q_len bounds every sequence's new tokens; pass max(qo_indptr[b+1] - qo_indptr[b]) "
                                "or None (T).")
        if _host_readable(seqlens):
            bad = [i for i, (n, s) in enumerate(zip((c - a for a, c in zip(ip, ip[1:])), seqlens.tolist())) if n > s]
            MLA_PREFILL.require(backend_name(backend), not bad, "seqlens", f"is smaller than the new tokens of "
                                f"sequences {bad[:4]}", seqlens, "seqlens[b] >= qo_indptr[b+1] - qo_indptr[b]",
                                "seqlens counts the cached prefix plus the new tokens.")
    _check_pool(MLA_PREFILL, backend, kv_cache, kv_scale, dims, block_table, seqlens, max_seqlen)
    softmax_scale = _softmax_scale(MLA_PREFILL, backend, softmax_scale)
    kv_cache = _as_bytes(kv_cache)
    bucket = {"batch": dims["B"], "seqlen": dims["pages"] * dims["page"], "heads": dims["H"],
              "kv_dtype": kv_dtype_name(kv_cache), "q_len": int(max_q_len) if max_q_len is not None else dims["T"]}
    b = _select(MLA_PREFILL, backend, q, kv_cache, q_len=None, bucket=bucket)
    cfg, _ = resolve_config(MLA_PREFILL.name, b, bucket, q.device, config)
    return b.impl(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, kv_scale=kv_scale,
                  max_q_len=max_q_len, config=cfg)


def store_kv(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, *,
             kv_scale: float | torch.Tensor | None = None, backend: str | Backend | None = None) -> None:
    """Write latent rows into the paged cache, in place.

    Args:
        kv_cache: [P, page_size, 576] bf16 | fp16 | fp32 | uint8 (fp8_e4m3 bytes); modified.
        slots: [T] int64, page * page_size + offset per row; -1 skips the row (padding). Slots
            outside the pool are skipped by the triton kernel (no device sync to report them) and
            raise in the torch backend.
        latent: [T, 576] bf16 | fp16 | fp32, last dim contiguous.
        kv_scale: required for uint8 pools: bytes = e4m3(latent / kv_scale), saturated to ±448.
    Graph-safe for the triton backend."""
    dims = STORE_KV.check(backend_name(backend), kv_cache=kv_cache, slots=slots, latent=latent)
    _check_pool(STORE_KV, backend, kv_cache, kv_scale, dims, None, None, None)
    kv_cache = _as_bytes(kv_cache)
    b = _select(STORE_KV, backend, latent, kv_cache, q_len=None)
    if slots.numel() == 0:
        return None
    b.impl(kv_cache, slots, latent, kv_scale=kv_scale, config=b.config())
    return None


# ---------------------------------------------------------------------------------------------
# selection and configs


def backend_name(backend: str | Backend | None) -> str | None:
    return backend.name if isinstance(backend, Backend) else backend


class ReplayedCapture:
    """One decode graph's capture: calls inside are captured into a CUDA graph that is replayed on other sequence
    lengths and block tables (the runtime's decode graphs).

    seqlens: [B] int32 host tensor, the lengths the calls inside run on (the warm-up and capture step), or None.
    A backend that plans on the host from the step's lengths (options `host_plan`, e.g. flashinfer) would replay a
    stale plan: with seqlens None selection skips it and naming it raises; with seqlens given, one that can re-plan
    into fixed buffers (options `graph_replan`) plans for them, registers its re-plan here, and the graph's owner
    calls `replan(seqlens)` with each step's host lengths before the replay."""

    def __init__(self, seqlens: torch.Tensor | None = None):
        if seqlens is not None and (seqlens.device.type != "cpu" or seqlens.dtype != torch.int32 or seqlens.dim() != 1):
            raise ValueError(f"ReplayedCapture seqlens must be a [B] int32 host tensor, got {seqlens.dtype} "
                             f"{tuple(seqlens.shape)} on {seqlens.device}")
        self.seqlens = seqlens
        self._replans: dict[object, Callable[[torch.Tensor], None]] = {}

    @property
    def can_replan(self) -> bool:
        return self.seqlens is not None

    def register(self, key: object, replan: Callable[[torch.Tensor], None]) -> bool:
        """Add `replan(seqlens [B] int32 host)` under `key` (one per planned object, however many layers call it);
        False when that key was already registered."""
        if key in self._replans:
            return False
        self._replans[key] = replan
        return True

    def replan(self, seqlens: torch.Tensor) -> None:
        """Before a replay: re-plan every host-planned backend captured here for the step's lengths, [B] int32 on
        the host (padding rows included: the graph runs them too)."""
        for fn in self._replans.values():
            fn(seqlens)

    def __len__(self) -> int:
        return len(self._replans)


_REPLAYED_CAPTURE: list[ReplayedCapture | None] = [None]


@contextmanager
def replayed_graph_capture(seqlens: torch.Tensor | None = None) -> Iterator[ReplayedCapture]:
    """Calls inside are captured into CUDA graphs that are replayed on other sequence lengths and block tables.
    seqlens: the [B] int32 host lengths the calls inside run on; given, host-planned backends that can re-plan
    (flashinfer) are captured too and the yielded `ReplayedCapture` re-plans them before each replay; None, selection
    skips every host-planned backend and naming one raises."""
    before = _REPLAYED_CAPTURE[0]
    cap = _REPLAYED_CAPTURE[0] = ReplayedCapture(seqlens)
    try:
        yield cap
    finally:
        _REPLAYED_CAPTURE[0] = before


def current_replayed_capture() -> ReplayedCapture | None:
    """The replayed-graph capture the caller runs in (`replayed_graph_capture`), else None."""
    return _REPLAYED_CAPTURE[0]


def supports(b: Backend, *, page_size: int, kv_dtype: str, q_dtype: str, q_len: int | None,
             replayed: bool = False, arch: str | None = None, replan: bool = False) -> str | None:
    """None if backend `b` supports these features (per its `options`), else why not. replayed: the call is
    captured into a CUDA graph replayed on other metadata (`replayed_graph_capture`); replan: that capture re-plans
    host-planned backends before each replay (it knows the host lengths); arch: the device's (checked against
    options `kv_dtype_archs`, e.g. flashinfer's fp8 cache on sm90 only; None skips that check)."""
    opts = b.options
    kv_archs = opts.get("kv_dtype_archs", {}).get(kv_dtype)
    if arch is not None and kv_archs is not None and arch not in kv_archs:
        return f"kv cache dtype {kv_dtype} runs on {', '.join(kv_archs)} only, not {arch}"
    if replayed and opts.get("host_plan") and not (replan and opts.get("graph_replan")):
        return ("it plans on the host from the step's sequence lengths, so a CUDA graph replayed on other lengths "
                "would run a stale plan" + ("" if opts.get("graph_replan") else " (it cannot re-plan before a replay)"))
    if "page_sizes" in opts and page_size not in opts["page_sizes"]:
        return f"page size {page_size} not in {tuple(opts['page_sizes'])}"
    if "kv_dtypes" in opts and kv_dtype not in opts["kv_dtypes"]:
        return f"kv cache dtype {kv_dtype} not in {tuple(opts['kv_dtypes'])}"
    if "q_dtypes" in opts and q_dtype not in opts["q_dtypes"]:
        return f"q dtype {q_dtype} not in {tuple(opts['q_dtypes'])}"
    if q_len is not None and "q_lens" in opts and q_len not in opts["q_lens"]:
        return f"S_q={q_len} not in {tuple(opts['q_lens'])}"
    return None


def kv_dtype_name(kv_cache: torch.Tensor) -> str:
    """The cache's dtype as the ops name it: "fp8" for a pool of e4m3 bytes (kv_cache [P, page, 576] uint8 or
    float8_e4m3fn), else "bf16", "fp16" or "fp32"."""
    return "fp8" if kv_cache.dtype in (torch.uint8, getattr(torch, "float8_e4m3fn", None)) else dtype_name(kv_cache.dtype)


def _select(op: Op, backend: str | Backend | None, q: torch.Tensor, kv_cache: torch.Tensor,
            q_len: int | None, bucket: Mapping[str, Any] | None = None) -> Backend:
    cap = _REPLAYED_CAPTURE[0]
    feats = dict(page_size=kv_cache.shape[1], kv_dtype=kv_dtype_name(kv_cache), q_dtype=dtype_name(q.dtype),
                 q_len=q_len, replayed=cap is not None, replan=cap is not None and cap.can_replan,
                 arch=registry.detect_arch(q.device))
    if isinstance(backend, Backend):  # explicit object: the caller vouches that it runs here
        chosen = backend
    elif backend is not None:
        chosen = registry.select(op.name, backend, device=q.device)
    else:  # the choice depends only on these keys: made once each (a tuned winner not installed here costs a
        # raised error each time it is asked for)
        key = (op.name, tuple(sorted((bucket or {}).items())), str(q.device), tuple(sorted(feats.items())),
               _config_dir())
        chosen = _SELECTED.get(key)
        if chosen is None:
            chosen = _SELECTED[key] = _auto_select(op, q.device, bucket, feats)
        return chosen
    why = supports(chosen, **feats)
    if why and feats["replayed"] and chosen.options.get("host_plan"):
        raise RuntimeError(f"{op.name} backend {chosen.name!r} cannot run in these CUDA graphs: {why}. Capture under "
                           "replayed_graph_capture(seqlens) so that it re-plans before each replay, serve with "
                           "--disable-cuda-graph, or leave the attention backend unset (graphs then take one that "
                           "plans on the device).")
    if why:
        raise ShapeError(op.name, chosen.name, "q" if why.startswith(("q ", "S_q")) else "kv_cache",
                         f"is not supported by this backend ({why})", "a supported configuration",
                         f"page_size={feats['page_size']} kv={feats['kv_dtype']} q={feats['q_dtype']} S_q={q_len}",
                         "Pick another backend (backend=None chooses one that supports these inputs).")
    return chosen


def _auto_select(op: Op, device: torch.device, bucket: Mapping[str, Any] | None, feats: dict) -> Backend:
    """The tuned winner of the nearest bucket if it runs here and supports `feats`, else the registry's choice
    among the backends that support them and are preferred for this cache dtype without a measurement (options
    `auto_kv_dtypes`: flashinfer reads fp8 pools, but 1.7–5.3× slower than pdlab's kernels on H200)."""
    accept = lambda b: supports(b, **feats) is None  # noqa: E731
    tuned = _tuned_backend(op.name, bucket, device) if bucket else None
    if tuned is not None:
        try:
            b = registry.select(op.name, tuned, device=device)
            if accept(b):
                return b
        except (KeyError, RuntimeError):  # the tuned winner is not usable here: fall back
            pass
    unmeasured = lambda b: accept(b) and feats["kv_dtype"] in b.options.get(  # noqa: E731
        "auto_kv_dtypes", (feats["kv_dtype"],))
    return registry.select(op.name, None, device=device, accept=unmeasured)


# keyed, like kernels.tuned's own cache, by $PDLAB_CONFIG_DIR too: a process that points it elsewhere gets that store
_SELECTED: dict[tuple, Backend] = {}
_CONFIG_CACHE: dict[tuple, tuple[dict, str]] = {}
_BACKEND_CACHE: dict[tuple, str | None] = {}


def _config_dir() -> str:
    return os.environ.get(tuned.CONFIG_DIR_ENV, "")


def _tuned_backend(op: str, bucket: Mapping[str, Any], device: torch.device) -> str | None:
    """The backend that won the nearest tuned bucket on this device (None if untuned); cached."""
    key = (op, tuple(sorted(bucket.items())), str(device), _config_dir())
    if key not in _BACKEND_CACHE:
        name = None
        try:
            from pdlab.kernels.tuned import resolve_backend
        except ImportError:
            resolve_backend = None
        if resolve_backend is not None:
            try:
                name = resolve_backend(op, dict(bucket), device=device)
            except (OSError, ValueError, KeyError):
                name = None
        _BACKEND_CACHE[key] = name
    return _BACKEND_CACHE[key]


def resolve_config(op: str, b: Backend, bucket: Mapping[str, int], device: torch.device | None,
                   config: Mapping[str, Any] | None = None) -> tuple[dict, str]:
    """(config, source) for backend `b`: explicit `config` (merged over the default) > tuned > default.
    source: "explicit", "tuned:<file>" or "default"."""
    if config is not None:
        return b.config(config), "explicit"
    key = (op, b.name, tuple(sorted(bucket.items())), str(device), _config_dir())
    hit = _CONFIG_CACHE.get(key)
    if hit is None:
        hit = (b.config(), "default")
        try:
            from pdlab.kernels.tuned import resolve_config as tuned_resolve
        except ImportError:
            tuned_resolve = None
        if tuned_resolve is not None and b.config_space:
            try:
                cfg, source = tuned_resolve(op, b.name, dict(bucket), device=device)
                hit = (b.config({k: v for k, v in cfg.items() if k in b.config_space or k in b.default_config}),
                       source)
            except (OSError, ValueError, KeyError) as exc:  # a bad tuned file must not break the op
                hit = (b.config(), f"default (tuned lookup failed: {exc})")
        _CONFIG_CACHE[key] = hit
    return dict(hit[0]), hit[1]


def clear_config_cache() -> None:
    """Forget resolved configs and tuned backend choices (after writing new tuned files)."""
    _CONFIG_CACHE.clear()
    _BACKEND_CACHE.clear()
    _SELECTED.clear()


tuned.on_clear_cache(clear_config_cache)


def _as_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    if kv_cache.dtype == getattr(torch, "float8_e4m3fn", None):
        return kv_cache.view(torch.uint8)
    return kv_cache


def _softmax_scale(op: Op, backend, value) -> float:
    """`value` as the float the kernels take; a ShapeError naming it when it is no finite number > 0 (None, NaN,
    inf, 0 or below: the output would be NaN or meaningless, with nothing said)."""
    try:
        scale = float(value)
    except (TypeError, ValueError, RuntimeError):  # None, a non-number, a tensor of several values
        scale = math.nan
    if math.isfinite(scale) and scale > 0:  # the message below is built only for a bad value (a call per layer)
        return scale
    op.require(backend_name(backend), False, "softmax_scale", f"is {value!r:.60}",
               value, "a finite number > 0",
               "softmax_scale multiplies q·k before the softmax: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), "
               "1/sqrt(192) for DeepSeek-V3/R1 (times YaRN's mscale² with rope scaling).")
    return scale


def _check_pool(op: Op, backend, kv_cache: torch.Tensor, kv_scale, dims: Mapping[str, int],
                block_table: torch.Tensor | None, seqlens: torch.Tensor | None, max_seqlen: int | None) -> None:
    name = backend_name(backend)
    page = dims["page"]
    op.require(name, page in PAGE_SIZES, "kv_cache", f"has page size {page}", kv_cache,
               "page size a power of two in 1..128", "Allocate the pool as [num_pages, page_size, 576] "
               "with page_size in 1, 2, 4, ..., 128 (64 is the default).")
    fp8 = kv_dtype_name(kv_cache) == "fp8"
    op.require(name, not fp8 or kv_scale is not None, "kv_scale", "is missing for an fp8 (uint8) pool", kv_cache,
               "kv_scale (float or 1-element fp32 tensor)", "fp8 pools need the per-tensor scale they were written with.")
    op.require(name, fp8 or kv_scale is None, "kv_scale", "was given for a non-fp8 pool", kv_cache,
               "kv_scale=None for bf16/fp16/fp32 pools", "kv_scale only applies to uint8 (fp8_e4m3) pools.")
    if isinstance(kv_scale, torch.Tensor):
        op.require(name, kv_scale.numel() == 1 and kv_scale.dtype == torch.float32, "kv_scale",
                   "must be a 1-element fp32 tensor", kv_scale, "[] or [1] fp32")
    elif kv_scale is not None:  # a host number: checked for free (a tensor's value would need a device sync)
        op.require(name, is_scale(kv_scale), "kv_scale",
                   f"is {kv_scale!r}", kv_scale, "a finite number > 0",
                   "kv_scale is the fp8 pool's dequant scale (value = e4m3 * kv_scale): pass the positive scale the "
                   "pool was written with (1.0 when unsure).")
    if block_table is None:
        return
    capacity = dims["pages"] * page
    hint = (f"The block table gives {dims['pages']} pages of {page} tokens = {capacity} tokens per sequence: "
            f"widen block_table or use larger pages.")
    if max_seqlen is not None:
        op.require(name, isinstance(max_seqlen, numbers.Integral) and not isinstance(max_seqlen, bool)
                   and int(max_seqlen) >= 0, "max_seqlen", f"is {max_seqlen!r}", max_seqlen, "an int >= 0 or None",
                   "max_seqlen is a host-known bound of seqlens: pass the longest sequence's length (or None).")
        op.require(name, int(max_seqlen) <= capacity, "seqlens", f"reaches {max_seqlen} tokens, beyond the pages given",
                   seqlens, f"seqlens <= pages*page_size = {capacity}", hint)
    if seqlens is not None and seqlens.device.type == "cpu" and seqlens.numel():  # host tensor: free check
        top = int(seqlens.max())
        op.require(name, top <= capacity, "seqlens", f"reaches {top} tokens, beyond the pages given", seqlens,
                   f"seqlens <= pages*page_size = {capacity}", hint)
        op.require(name, max_seqlen is None or top <= int(max_seqlen), "seqlens",
                   f"reaches {top} tokens, beyond max_seqlen={max_seqlen}", seqlens, f"seqlens <= {max_seqlen}",
                   "max_seqlen is a bound of seqlens: pass the longest sequence's length (or leave it None).")
        if "Sq" in dims:  # decode: S_q new tokens per sequence (a prefill checks against its qo_indptr, where a
            # sequence may add no token: the empty sequences of a prefill graph)
            low, need = int(seqlens.min()), dims["Sq"]
            op.require(name, low >= need, "seqlens", f"has a sequence of {low} tokens, fewer than its {need} new ones",
                       seqlens, f"seqlens >= S_q = {need}", "seqlens counts the cached prefix plus this step's tokens.")
