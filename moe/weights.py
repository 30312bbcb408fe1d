"""Expert weights of one MoE layer: bf16 and/or NVFP4 (modelopt layout), with per-runner repacks.

Convention (DeepSeek / modelopt / transformers ``gate_up_proj``): ``w13`` stacks gate then up along
the output dim — rows ``[0, I)`` are the gate projection, rows ``[I, 2I)`` the up projection — so
an expert computes ``down(silu(x @ gate.T) * (x @ up.T))`` with ``w2`` = down ``[H, I]``.

Tensors (E experts, hidden H, intermediate I):

- bf16: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.
- NVFP4 (modelopt names): ``w13_weight [E, 2I, H/2] uint8``, ``w13_weight_scale [E, 2I, H/16]
  float8_e4m3fn``, ``w13_weight_scale_2 [E] fp32`` (= amax/(6·448)), ``w13_input_scale [E] fp32``
  (activation amax/(6·448)); ``w2_weight [E, H, I/2]``, ``w2_weight_scale [E, H, I/16]``,
  ``w2_weight_scale_2 [E]``, ``w2_input_scale [E]``. Value = e2m1 · weight_scale · weight_scale_2.

Runner-specific layouts (swizzled scales, alphas, ...) are computed once by `prepare` and cached in
``prepared[runner]``; never per call.

Storage layouts of the NVFP4 tensors (`ExpertWeights.nvfp4_layout`), each converted in place one expert at a
time so that a server holds one copy of the experts; the tensors keep their modelopt shapes and everything that
needs the modelopt byte order reads it through `plain_nvfp4()` (a copy while reordered):

- "modelopt": as loaded.
- "tiled" (`tile_nvfp4`, `tile_()`): 16-row × 128-element tiles stored contiguously, for the Triton runner's
  in-loop kernel.
- "fragment" (`frag_()`, moe/triton/nvfp4_frag.py): each thread's wgmma fragment bytes contiguous, for the
  Triton runner's Gluon GEMMs on sm90.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from pdlab.kernels import nvfp4
from pdlab.kernels.contracts import Op, Spec

_WEIGHT_HINT = ("modelopt NVFP4 MoE tensors are stacked per layer: w13 = gate rows then up rows [E, 2I, H/2], "
                "w2 = down [E, H, I/2], block scales one per 16 elements of the last (input) dim.")

MODELOPT = Op(
    "moe_weights",
    inputs={
        "w13_weight": Spec("E 2*I H/2", "uint8"),
        "w13_weight_scale": Spec("E 2*I H/16", "fp8_e4m3|uint8"),
        "w2_weight": Spec("E H I/2", "uint8"),
        "w2_weight_scale": Spec("E H I/16", "fp8_e4m3|uint8"),
        "w13_weight_scale_2": Spec("...", "fp32|bf16"),
        "w2_weight_scale_2": Spec("...", "fp32|bf16"),
        "w13_input_scale": Spec("...", "fp32|bf16", optional=True),
        "w2_input_scale": Spec("...", "fp32|bf16", optional=True),
        "w13": Spec("E 2*I H", "bf16|fp16|fp32"),
        "w2": Spec("E H I", "bf16|fp16|fp32"),
    },
    hints={k: _WEIGHT_HINT for k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13", "w2")},
)

NVFP4_KEYS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
              "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")


@dataclass
class ExpertWeights:
    """Weights of E experts. Either form may be absent (None); `has_bf16` / `has_nvfp4` say which.

    bf16: w13 [E, 2I, H], w2 [E, H, I]. nvfp4: the modelopt tensors named in the module docstring,
    scale_2 and input scales always [E] fp32 here. prepared: runner name → its repacked weights.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    w13_weight: torch.Tensor | None = None
    w13_weight_scale: torch.Tensor | None = None
    w13_weight_scale_2: torch.Tensor | None = None
    w13_input_scale: torch.Tensor | None = None
    w2_weight: torch.Tensor | None = None
    w2_weight_scale: torch.Tensor | None = None
    w2_weight_scale_2: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None
    prepared: dict[str, Any] = field(default_factory=dict, repr=False)
    nvfp4_layout: str = "modelopt"  # how the NVFP4 weights and block scales are stored: NVFP4_LAYOUTS

    @property
    def nvfp4_tiled(self) -> bool:
        """The NVFP4 tensors are stored in the tiled layout (`tile_`)."""
        return self.nvfp4_layout == "tiled"

    @property
    def nvfp4_frag(self) -> bool:
        """The NVFP4 tensors are stored in fragment order (`frag_`)."""
        return self.nvfp4_layout == "fragment"

    @property
    def has_bf16(self) -> bool:
        return self.w13 is not None

    @property
    def has_nvfp4(self) -> bool:
        return self.w13_weight is not None

    @property
    def device(self) -> torch.device:
        return (self.w13 if self.has_bf16 else self.w13_weight).device

    @property
    def activation_global_scale(self) -> torch.Tensor:
        """The layer's static NVFP4 activation global scale for dispatch: 1 / max(w13_input_scale),
        fp32 scalar [] (one scale shared by all experts, since a token is quantized before it is routed)."""
        if self.w13_input_scale is None:
            raise ValueError("these ExpertWeights carry no w13_input_scale: load NVFP4 weights or pass "
                             "input scales to from_bf16(..., input_amax=...)")
        return (1.0 / self.w13_input_scale.float().max()).reshape(())

    # ---- construction

    @classmethod
    def from_bf16(cls, w13: torch.Tensor, w2: torch.Tensor, quantize: bool = True, keep_bf16: bool = True,
                  input_amax: float | tuple[float, float] = 8.0) -> "ExpertWeights":
        """From bf16 experts: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

        quantize: also build the NVFP4 tensors with the modelopt recipe (per-expert weight_scale_2).
        input_amax: assumed activation amax for the (w13, w2) input scales (amax/(6·448)); real
        checkpoints carry calibrated values. keep_bf16: keep the bf16 tensors as well."""
        MODELOPT.check(None, w13=w13, w2=w2)
        E, two_i, H = w13.shape
        out = cls(E, H, two_i // 2, w13 if keep_bf16 or not quantize else None, w2 if keep_bf16 or not quantize else None)
        if quantize:
            a13, a2 = (input_amax, input_amax) if isinstance(input_amax, (int, float)) else input_amax
            q13 = nvfp4.quantize_weight_modelopt(w13)
            q2 = nvfp4.quantize_weight_modelopt(w2)
            dev = w13.device
            out.w13_weight, out.w13_weight_scale, out.w13_weight_scale_2 = (
                q13["weight"], q13["weight_scale"], q13["weight_scale_2"].reshape(E))
            out.w2_weight, out.w2_weight_scale, out.w2_weight_scale_2 = (
                q2["weight"], q2["weight_scale"], q2["weight_scale_2"].reshape(E))
            out.w13_input_scale = torch.full((E,), a13 / (6 * 448), dtype=torch.float32, device=dev)
            out.w2_input_scale = torch.full((E,), a2 / (6 * 448), dtype=torch.float32, device=dev)
        return out

    @classmethod
    def from_modelopt(cls, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> "ExpertWeights":
        """From stacked modelopt NVFP4 tensors: {prefix + name: tensor} for the names in NVFP4_KEYS
        (input scales optional). scale_2 / input scales may be scalars, [E], or [E, 2] (separate gate
        and up scales; folded to their max with the block scales rescaled). Shapes are checked and a
        mismatch raises ShapeError naming the tensor."""
        missing = [k for k in NVFP4_KEYS if "input_scale" not in k and prefix + k not in tensors]
        if missing:
            raise KeyError(f"from_modelopt: missing tensors {[prefix + k for k in missing]}; "
                           f"present: {sorted(tensors)[:12]}")
        t = {k: tensors.get(prefix + k) for k in NVFP4_KEYS}
        dims = MODELOPT.check(None, **{k: v for k, v in t.items()})
        E, H, I = dims["E"], dims["H"], dims["I"]
        w13s = _as_e4m3(t["w13_weight_scale"])
        s13 = t["w13_weight_scale_2"].float()
        if s13.dim() == 2 and s13.shape == (E, 2):  # separate gate / up global scales: fold to the max
            new = s13.amax(1)
            ratio = (s13 / new[:, None]).repeat_interleave(I, dim=1)  # [E, 2I]
            w13s = (w13s.float() * ratio[..., None]).to(torch.float8_e4m3fn)
            s13 = new
        w = cls(E, H, I)
        w.w13_weight, w.w13_weight_scale = t["w13_weight"], w13s
        w.w13_weight_scale_2 = _per_expert(s13, E, "w13_weight_scale_2")
        w.w2_weight, w.w2_weight_scale = t["w2_weight"], _as_e4m3(t["w2_weight_scale"])
        w.w2_weight_scale_2 = _per_expert(t["w2_weight_scale_2"], E, "w2_weight_scale_2")
        for k in ("w13_input_scale", "w2_input_scale"):
            if t[k] is not None:
                v = t[k].float()
                setattr(w, k, _per_expert(v.amax(-1) if v.dim() == 2 else v, E, k))
        return w

    def to(self, device: torch.device | str) -> "ExpertWeights":
        """A copy on `device` (prepared repacks are dropped and rebuilt on first use)."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()
              if k != "prepared"}
        return ExpertWeights(**kw)

    # ---- NVFP4 storage layout

    @property
    def can_tile(self) -> bool:
        """NVFP4 weights whose H and I are multiples of 128 (the tiled layout's K chunk)."""
        return self.has_nvfp4 and self.hidden_size % 128 == 0 and self.intermediate_size % 128 == 0

    def tile_(self) -> "ExpertWeights":
        """Store the NVFP4 weights and block scales in the tiled layout (`tile_nvfp4`), in place, one expert at
        a time (transient memory: one expert's tensors). Drops the prepared repacks. No-op when already tiled.
        Raises ValueError when the shapes do not tile (H and I must be multiples of 128)."""
        return self._store_as_("tiled", tile_nvfp4)

    def frag_(self) -> "ExpertWeights":
        """Store the NVFP4 weights and block scales in the fragment order of the Triton runner's Gluon GEMMs
        (moe/triton/nvfp4_frag.py: `pack_weights`, `pack_scales`), in place, one expert at a time; the tensors
        keep their modelopt shapes ([E, N, K/2] uint8, [E, N, K/16] e4m3), their bytes reordered. Drops the
        prepared repacks. No-op when already in fragment order. Raises ValueError when H or I is not a multiple
        of 128."""
        from pdlab.moe.triton.nvfp4_frag import pack_scales, pack_weights

        def pack(w, sf):
            return pack_weights(w).view(w.shape), pack_scales(sf).view(sf.shape)

        return self._store_as_("fragment", pack)

    def store_(self, layout: str) -> "ExpertWeights":
        """Store the NVFP4 tensors in `layout` (NVFP4_LAYOUTS: "modelopt", "tiled", "fragment"), in place, one expert
        at a time, from whichever layout they are in. Raises ValueError for an unknown layout, or (tiled,
        fragment) when H or I is not a multiple of 128."""
        if layout == "tiled":
            return self.tile_()
        if layout == "fragment":
            return self.frag_()
        if layout == "modelopt":
            return self._store_as_("modelopt", lambda w, sf: (w, sf))
        raise ValueError(f"unknown NVFP4 layout {layout!r}; known: {', '.join(NVFP4_LAYOUTS)}")

    def _store_as_(self, layout: str, convert) -> "ExpertWeights":
        """Store the NVFP4 tensors in `layout`, in place, expert by expert: convert(w [1, N, K/2] uint8,
        sf [1, N, K/16] uint8) → the same shapes in `layout`, from the modelopt layout."""
        if self.nvfp4_layout == layout:
            return self
        if layout != "modelopt" and not self.can_tile:
            raise ValueError(f"{'tile_' if layout == 'tiled' else 'frag_'}: needs NVFP4 weights with H and I "
                             f"multiples of 128 (H={self.hidden_size}, I={self.intermediate_size}, "
                             f"nvfp4={self.has_nvfp4})")
        current = self.nvfp4_layout
        for wname, sname in (("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale")):
            # a view (e.g. this rank's experts sliced from all of them) is copied first: the tensor it views
            # may still be read in the plain layout by its owner
            w, sf = (t.clone() if t._base is not None or not t.is_contiguous() else t
                     for t in (getattr(self, wname), getattr(self, sname)))
            sb = sf.view(torch.uint8)
            for e in range(self.num_experts):
                we, se = _to_modelopt(w[e:e + 1], sb[e:e + 1], current)
                wt, st = convert(we, se)
                w[e:e + 1].copy_(wt)
                sb[e:e + 1].copy_(st)
            setattr(self, wname, w)
            setattr(self, sname, sf)
        self.nvfp4_layout = layout
        self.prepared.clear()
        return self

    def plain_nvfp4(self) -> dict[str, torch.Tensor]:
        """The four NVFP4 tensors in the modelopt layout: w13_weight [E, 2I, H/2] uint8, w13_weight_scale
        [E, 2I, H/16] e4m3, w2_weight [E, H, I/2] uint8, w2_weight_scale [E, H, I/16] e4m3 (copies in that
        layout when the weights are stored tiled or in fragment order)."""
        names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
        if self.nvfp4_layout == "modelopt":
            return {k: getattr(self, k) for k in names}
        w13, s13 = _to_modelopt(self.w13_weight, self.w13_weight_scale.view(torch.uint8), self.nvfp4_layout)
        w2, s2 = _to_modelopt(self.w2_weight, self.w2_weight_scale.view(torch.uint8), self.nvfp4_layout)
        return {"w13_weight": w13, "w13_weight_scale": s13.view(torch.float8_e4m3fn),
                "w2_weight": w2, "w2_weight_scale": s2.view(torch.float8_e4m3fn)}

    # ---- views used by runners

    def prepare(self, key: str, build: Callable[["ExpertWeights"], Any]) -> Any:
        """The runner's repacked weights, built once by `build(self)` and cached under `key`."""
        if key not in self.prepared:
            self.prepared[key] = build(self)
        return self.prepared[key]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) as real values of `dtype`: the NVFP4 tensors dequantised
        when present (what the NVFP4 runners compute with), else the bf16 ones."""
        if self.has_nvfp4:
            p = self.plain_nvfp4()
            return (nvfp4.dequantize_nvfp4(p["w13_weight"], p["w13_weight_scale"], 1.0 / self.w13_weight_scale_2,
                                           dtype),
                    nvfp4.dequantize_nvfp4(p["w2_weight"], p["w2_weight_scale"], 1.0 / self.w2_weight_scale_2, dtype))
        return self.w13.to(dtype), self.w2.to(dtype)

    def bf16(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in bf16: the bf16 tensors if present, else the NVFP4 ones dequantised once
        (cached)."""
        if self.has_bf16:
            return self.w13.to(torch.bfloat16), self.w2.to(torch.bfloat16)
        return self.prepare("bf16_dequantized", lambda w: w.dequantized(torch.bfloat16))


def quantize_in_chunks(make_chunk: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], experts: int,
                       chunk: int = 16) -> ExpertWeights:
    """NVFP4-only ExpertWeights of `experts` experts quantized `chunk` at a time.

    make_chunk(e0, n) → (w13 [n, 2I, H], w2 [n, H, I]) bf16/fp32 for experts e0..e0+n-1. weight_scale_2 is
    per expert, so the result equals quantizing the stacked tensors at once, at a fraction of the peak
    memory (one chunk of the high-precision experts and its fp32 quantizer temporaries)."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in NVFP4_KEYS}
    for e0 in range(0, experts, chunk):
        w13, w2 = make_chunk(e0, min(chunk, experts - e0))
        w = ExpertWeights.from_bf16(w13, w2, quantize=True, keep_bf16=False)
        del w13, w2
        for k in NVFP4_KEYS:
            parts[k].append(getattr(w, k))
    return ExpertWeights.from_modelopt({k: torch.cat(v) for k, v in parts.items()})


def tile_nvfp4(w: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Modelopt NVFP4 weights → the tiled layout: each 16-row × 128-element tile stored contiguously.

    w: [E, N, K/2] uint8 → [E, N, K/2] uint8 whose row-group g (rows 16g..16g+15), K chunk c holds the
    1024 bytes w[:, 16g:16g+16, 64c:64c+64] row by row; sf: [E, N, K/16] uint8 → likewise 16 × 8 bytes per
    chunk. N a multiple of 16, K of 128. The Triton decode GEMM then streams 1 KiB runs instead of 64-byte
    pieces of rows K/2 bytes apart."""
    E, N, KH = w.shape
    if N % 16 or KH % 64 or sf.shape != (E, N, KH // 8):
        raise ValueError(f"tile_nvfp4: need w [E, N, K/2] with N % 16 == 0, K % 128 == 0 and sf [E, N, K/16]; "
                         f"got w {tuple(w.shape)}, sf {tuple(sf.shape)}")
    return _swap_blocks(w, 64, to_tiled=True), _swap_blocks(sf, 8, to_tiled=True)


def untile_nvfp4(wt: torch.Tensor, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `tile_nvfp4`: tiled w [E, N, K/2] uint8, sf [E, N, K/16] uint8 → modelopt layout (copies)."""
    return _swap_blocks(wt, 64, to_tiled=False), _swap_blocks(st, 8, to_tiled=False)


def _swap_blocks(t: torch.Tensor, width: int, to_tiled: bool) -> torch.Tensor:
    """[E, N, C] bytes: swap the order of (16-row group member, `width`-byte chunk), i.e. rows-then-chunks ↔
    chunks-then-rows within each group of 16 rows (a copy)."""
    E, N, C = t.shape
    inner = (16, C // width) if to_tiled else (C // width, 16)
    return t.reshape(E, N // 16, *inner, width).permute(0, 1, 3, 2, 4).contiguous().view(E, N, C)


NVFP4_LAYOUTS = ("modelopt", "tiled", "fragment")


def _to_modelopt(w: torch.Tensor, sf: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 bytes w [E, N, K/2] and scale bytes sf [E, N, K/16] stored in `layout` → the modelopt layout (the
    inputs themselves when already in it, else copies)."""
    if layout == "modelopt":
        return w, sf
    if layout == "tiled":
        return untile_nvfp4(w, sf)
    if layout == "fragment":
        from pdlab.moe.triton.nvfp4_frag import TILE, unpack_scales, unpack_weights

        E, N, KH = w.shape
        shape = (E, N // TILE, 2 * KH // TILE)
        return (unpack_weights(w.reshape(*shape, 4, TILE, 16)),
                unpack_scales(sf.reshape(*shape, TILE, 8)))
    raise ValueError(f"unknown NVFP4 layout {layout!r}; known: {', '.join(NVFP4_LAYOUTS)}")


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def _per_expert(v: torch.Tensor, E: int, name: str) -> torch.Tensor:
    v = v.float().reshape(-1)
    if v.numel() == 1:
        return v.expand(E).contiguous()
    if v.numel() != E:
        raise ValueError(f"{name}: expected a scalar or [{E}] (one per expert), got {v.numel()} values")
    return v.contiguous()
