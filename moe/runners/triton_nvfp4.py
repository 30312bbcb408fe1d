"""Runner "triton": pdlab's NVFP4 W4A16 grouped GEMMs (moe/triton/nvfp4_moe.py), any CUDA GPU.

gate_up GEMM with SiLU·mul fused in its epilogue → intermediate [rows, I] (bf16) → down GEMM.
Both layouts; activations bf16 (fp16/fp32), fp8 (+ per-128 scales) or nvfp4 (dequantised on load).
Weights: the NVFP4 tensors as stored (uint8 bytes, e4m3 scales viewed as bytes), no repack.

Config (0 = chosen from the expected tokens per expert): BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
num_warps, num_stages for both GEMMs; SPLIT_K for the down GEMM (atomic fp32 accumulation);
SPLIT_NIBBLES=1 permutes K (even elements, then odd) so that the unpacked nibbles feed two dots
directly instead of being interleaved; MMA_FP16=1 runs the MMA in fp16 for bf16/fp8 activations
(scaled by 2^-8 on load; the dequantised weights are exact in fp16, which saves their bf16
conversion in the main loop); UNPACK16=1 unpacks the nibbles with 16-bit integer ops (no per-element
int32 → int16 truncation).

Knobs where -1 = chosen from the expected tokens per expert, 0 = off, 1 = on:
DEQ_ASM=1 unpacks 8 nibbles per 32-bit register with PTX (nibble → e4m3 byte, hardware e4m3x2 →
f16x2 conversion, block scale in f16x2; sm89+, fp16 MMA; the interpreter runs the integer unpack);
DEQ_ASM=2 builds the integer unpack's fp16 bits with byte permutes instead of the conversion instruction
(bit-equal to DEQ_ASM=0; on an H200 within ±4 % of DEQ_ASM=1: slower at 1–16 tokens per expert, 2 % faster at 64,
bench/results/NVIDIA_H200/moe_experts/2026-11-30_prmt), a choice for the tuner;
PERM_K=1 runs the MMA over a permuted K order (within each 32-element group) in which each thread's
weight bytes are 4 contiguous bytes in shared memory (32-bit loads instead of byte loads); the
activation tile is permuted the same way in registers, so the result is the same sum.
DENSE_MIN_M (bf16 activations, contiguous layout): at ≥ DENSE_MIN_M expected tokens per expert
(0 = never) the weights of DENSE_CHUNK experts at a time are dequantised to bf16 once
(moe/triton/nvfp4_dequant.py) and both GEMMs run in torch._grouped_mm (one host read of the
offsets per call: while a CUDA graph is being captured the in-loop kernel runs instead); DENSE_OVERLAP=1 (CUDA)
dequantises the next half-size chunk on a side stream while the current one's GEMMs run;
`dense_path_taken` says whether it runs.
TILED=1 runs the in-loop kernel over the tiled weight layout (`pdlab.moe.weights.tile_nvfp4`: each
16-row × 128-element tile contiguous); it needs H and I multiples of 128 and BLOCK_K a multiple of 128, and
is ignored otherwise. FRAG (-1 auto, 0, 1): the fragment-order Gluon GEMMs of moe/triton/nvfp4_frag.py (sm90,
Triton with Gluon; each thread reads its own wgmma fragments' weight bytes, no permutes), for
either layout and any payload; FRAG_BM (0 = 16 / 32 / 64 by the expected tokens per expert) tokens per program,
FRAG_XASYNC=1 has the down GEMM copy its activation tiles to shared memory with cp.async one tile ahead
instead of through registers (-1: with 64-token programs), FRAG_UNROLL K tiles the down GEMM loads together (0: 1
with FRAG_XASYNC and 64-token programs, else 2). On an H200 at EP4, 64 tokens/expert, the down GEMM takes 338 µs
as (0, 2) and 284 µs as (1, 1); at 1 and 16 tokens/expert (1, ·) is 1–2 % slower, and so is cp.async in gate_up
at every count (bench/results/NVIDIA_H200/moe_experts/2026-12-01_frag_stored/profile_frag.csv). Weights stored in
fragment order (`ExpertWeights.frag_()`, what the runtime does on sm90) always run them (or the dense path),
whatever FRAG says.
Otherwise they read a fragment-order copy built once (a second copy of the experts): auto takes them unless the
weights are stored tiled, 1 always. `frag_path_taken` says whether a call runs them.
FRAG_RING (-1 = 2): the gate_up GEMM's weight tiles through a shared ring of that many slots filled by cp.async
(0: loaded into registers at each step); FRAG_PAIR_DOWN (-1: on where H % 256 == 0) has each
down-GEMM program compute two adjacent N tiles from one pass over its activations; FRAG_RING_DOWN (-1: 2 with
FRAG_PAIR_DOWN, else 0) the down GEMM's ring (with a ring, FRAG_UNROLL and FRAG_XASYNC do not apply to that GEMM);
FRAG_MAXNREG (0 = none) a register cap per thread for both GEMMs; FRAG_PDL (-1 = 0) launches the two GEMMs with
programmatic dependent launch, so that each starts, and copies its first weight tiles, while the kernel before it
finishes (on an H200 at EP4: 3–6 µs faster at 1 token/expert in two of three A/B runs, within the runs' ±10–15 µs
noise at 16 and 64, so off unless tuned; the tuned EP4 decode entries turn it on); FRAG_XRING (-1 = 1) has a GEMM
with a weight ring take its activation tiles through the ring too, instead of loading them into registers at each
K step, where each load's L2 latency was exposed (458 → 421–445 µs at 1 token/expert, 521–527 → 457–506 µs at 16,
955–965 → 814–888 µs at 64;
bench/results/NVIDIA_H200/moe_experts/2026-12-01_activation_ring); FRAG_MMA_ASYNC (-1: on for 16- and 32-token
programs expecting more than one token per expert) has a GEMM with both rings issue its MMAs asynchronously by
half tiles, each half unpacked while the previous half's MMA runs (at EP4, 16 tokens/expert: faster in each of
eight A/B pairs, 3 % in geometric mean; at 1 and 64 tokens 0.999× and 1.004× the time, single pairs −3 % to +5 %;
one token on 8 of 256 experts, masked: 155 → 163–166 µs; bench/results/NVIDIA_H200/moe_experts/2026-12-01_async_mma).
EP4 on an H200, bf16 slab, 1 / 16 tokens/expert:
gate_up 317 → 300 / 325 → 311–323 µs with the ring, down 158 → 154 / 169 → 165 µs paired with its ring
(bench/results/NVIDIA_H200/moe_experts/2026-12-01_weight_ring).
FRAG_SLAB_LIST (-1: 1 where the layout bounds its rows, `Masked.max_rows`, as dispatch sets it; else 0): a masked
slab runs as the block list of its experts' token blocks, as contiguous rows do (the blocks of experts with rows
first, the grid bounded by max_rows), instead of one program per (expert, slab block) whose programs without rows
exit at once (0). On an H200, one token on 8 of 256 experts: 154 → 85 µs in a one-row slab, 473 → 85 µs in a
256-row slab (bench/results/NVIDIA_H200/moe_experts/2026-12-02_slab_list).
Weights stored tiled (`ExpertWeights.tile_()`, what the runtime does on CUDA) are read
as they are by every call (TILED auto → 1, BLOCK_K raised to 128) and by the dense path; otherwise a tiled
copy is built once beside the loaded tensors (a second copy of the NVFP4 weights).
The in-loop kernel takes a masked slab as the block list wherever the layout bounds its rows (no knob): one token on
8 of 256 experts in a 256-row slab, weights tiled, 457 → 122.5 µs on an H200
(bench/results/NVIDIA_H200/moe_experts/2026-12-04_inloop_slab_list).
"""

from __future__ import annotations

import os

import torch

from pdlab.kernels import registry
from pdlab.kernels.graphs import capturing
from pdlab.moe.layouts import Masked
from pdlab.moe.weights import tile_nvfp4

_DEFAULT = {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 8, "num_warps": 0, "num_stages": 0, "SPLIT_K": 1,
            "SPLIT_NIBBLES": 0, "MMA_FP16": 0, "UNPACK16": 0, "DEQ_ASM": -1, "PERM_K": -1, "DENSE_MIN_M": -1,
            "DENSE_CHUNK": 16, "DENSE_OVERLAP": 1, "TILED": -1, "FRAG": -1, "FRAG_BM": 0, "FRAG_UNROLL": 0,
            "FRAG_XASYNC": -1, "FRAG_RING": -1, "FRAG_RING_DOWN": -1, "FRAG_MAXNREG": 0, "FRAG_PAIR_DOWN": -1,
            "FRAG_PDL": -1, "FRAG_XRING": -1, "FRAG_MMA_ASYNC": -1, "FRAG_SLAB_LIST": -1}
_SPACE = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128, 256, 512],
          "GROUP_M": [1, 4, 8, 16], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5], "SPLIT_K": [1, 2, 4],
          "SPLIT_NIBBLES": [0, 1], "MMA_FP16": [0, 1],
          "UNPACK16": [0, 1], "DEQ_ASM": [0, 1, 2], "PERM_K": [0, 1], "DENSE_MIN_M": [0, 256, 512, 1024],
          "DENSE_CHUNK": [8, 16, 32], "DENSE_OVERLAP": [0, 1], "TILED": [0, 1], "FRAG": [0, 1], "FRAG_BM": [16, 32, 64],
          "FRAG_UNROLL": [1, 2], "FRAG_XASYNC": [0, 1], "FRAG_RING": [0, 2, 3], "FRAG_RING_DOWN": [0, 2, 3],
          "FRAG_MAXNREG": [0, 128], "FRAG_PAIR_DOWN": [0, 1], "FRAG_PDL": [0, 1], "FRAG_XRING": [0, 1],
          "FRAG_MMA_ASYNC": [0, 1], "FRAG_SLAB_LIST": [0, 1]}
_AUTO_MINUS1 = ("DEQ_ASM", "PERM_K", "DENSE_MIN_M", "TILED")  # the FRAG_* knobs' -1 is decided in _run_frag


def _probe() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return None
    return "needs a CUDA GPU (or TRITON_INTERPRET=1 for CPU tests)"


def program_tokens(expected_m: int) -> int:
    """Tokens per program of the decode kernels by the expected tokens per expert: 16 / 32 / 64."""
    return 16 if expected_m <= 16 else 32 if expected_m <= 32 else 64


def default_mma_async(block_m: int, expected_m: int) -> bool:
    """FRAG_MMA_ASYNC's automatic choice: 16- and 32-token programs when more than one token per expert is expected
    (measured: faster at 16 tokens per expert, the same at 64 and at 1 on every expert, slower with one token on 8
    of 256 experts)."""
    return block_m <= 32 and expected_m >= 2


def heuristic_config(expected_m: int, interpret: bool = False) -> dict:
    """Defaults by tokens per expert: decode streams weights (small BLOCK_M, wide BLOCK_K), prefill
    is a compute-bound tiled GEMM."""
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    # measured on H200 (bench/results/NVIDIA_H200/moe_experts/2026-11-29_deq_asm): DEQ_ASM + PERM_K with
    # BLOCK_N 128, BLOCK_K 128, 3 stages: 1.35 → 0.89 ms at 1 and 16 tokens/expert, 2.16 → 1.81 ms at 64;
    # the dense path beat the in-loop kernel at 512 (6.9 vs 10.2 ms) and 2048 tokens/expert (21.5 vs 40.5 ms)
    # 2026-11-30 (moe_experts/2026-11-30_tiled, per GEMM at EP4 decode): 16-byte weight copies (the K offset
    # declared BLOCK_K-aligned) 896 → 739 µs, and the tiled weight layout 739 → 671 µs at 1 and 16 tokens/expert
    fast = {"DEQ_ASM": 1, "PERM_K": 1}
    if expected_m <= 64:
        return {"BLOCK_M": program_tokens(expected_m), "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
                "num_stages": 3, "TILED": 1, **fast}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "DENSE_MIN_M": 256,
            **fast}


def gemm_dtypes(payload: str, act_dtype: torch.dtype, cfg: dict, interpret: bool = False):
    """(activation kind, gate_up MMA dtype, intermediate dtype, down MMA dtype) for a layout payload ("bf16",
    "fp8", "nvfp4") whose float activations are `act_dtype`, under a resolved config: fp16 MMAs where MMA_FP16
    or the PTX unpack (DEQ_ASM, fp16 only) asks for them; fp32 under the interpreter, whose bf16 dot is not
    exact."""
    from pdlab.moe.triton.nvfp4_moe import A_FLOAT, A_FP8, A_NVFP4

    fp16 = bool(cfg.get("MMA_FP16") or (cfg.get("DEQ_ASM") and not interpret))
    if payload == "bf16":
        kind, mma, inter = A_FLOAT, act_dtype, act_dtype
    else:
        kind = A_FP8 if payload == "fp8" else A_NVFP4
        mma = torch.float32 if interpret else (torch.float16 if kind == A_NVFP4 else torch.bfloat16)
        inter = torch.float32 if interpret else torch.bfloat16
    if fp16 and kind != A_NVFP4:
        mma = torch.float16
    elif interpret and mma == torch.bfloat16:
        mma = torch.float32
    down = torch.float16 if fp16 else (torch.float32 if interpret else inter)
    return kind, mma, inter, down


def launch_key(layout, weights, config: dict) -> tuple:
    """What decides the kernels `run_triton(layout, weights, config=config)` compiles (`config` as run_experts passes
    it, with "_expected_m"): the path, the config with its auto knobs resolved at that expected_m, and the two
    choices the fragment GEMMs derive from it (`program_tokens`, and one token per expert or more for
    `default_mma_async`). Every launch option of the paths is a function of these."""
    cfg = dict(config)
    expected_m = int(cfg.pop("_expected_m", 16))
    cfg = resolve_config({**_DEFAULT, **cfg}, expected_m, os.environ.get("TRITON_INTERPRET") == "1")
    return (_choose_path(layout, weights, cfg, expected_m), tuple(sorted(cfg.items())), program_tokens(expected_m),
            expected_m >= 2)


def size_problem(hidden_size: int, intermediate_size: int) -> str | None:
    """Why these experts' sizes do not fit the triton GEMMs (each reduces over its K in tiles of at least 32
    elements), else None."""
    bad = [f"{n}={v}" for n, v in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size))
           if v % 32]
    if not bad:
        return None
    return (f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of 32: the triton NVFP4 GEMMs "
            "reduce over K in tiles of 32")


@registry.register_backend("moe_experts", "triton", archs=("cuda",), packages=("triton",), probe=_probe,
                           priority=20, config_space=_SPACE, default_config=_DEFAULT,
                           options={"layouts": ("contiguous", "masked"), "payloads": ("bf16", "fp8", "nvfp4"),
                                    "weights": ("nvfp4",), "interpretable": True, "launch_key": launch_key,
                                    "size_problem": size_problem})
def run_triton(layout, weights, *, config):
    """NVFP4 W4A16 experts: fused gate_up+SiLU·mul GEMM, then down GEMM."""
    from pdlab.moe.triton.nvfp4_moe import A_FLOAT, A_FP8, A_NVFP4, moe_nvfp4_gemm

    if not weights.has_nvfp4:
        raise ValueError("moe_experts[triton] runs NVFP4 weights: build them with "
                         "ExpertWeights.from_bf16(..., quantize=True) or from_modelopt(...)")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = dict(config)
    expected_m = cfg.pop("_expected_m", 16)
    auto_tiled = int(cfg.get("TILED", -1)) == -1
    cfg = resolve_config(cfg, expected_m, interpret)
    path = _choose_path(layout, weights, cfg, expected_m)
    if path == "dense":
        return _run_dense(layout, weights, cfg)
    if path == "fragment":
        return _run_frag(layout, weights, cfg, expected_m)
    if weights.nvfp4_tiled and auto_tiled:
        # weights stored tiled (ExpertWeights.tile_): every in-loop call reads them as they are; a plain copy
        # would double the experts' memory. The tiled kernels need BLOCK_K a multiple of 128.
        cfg["TILED"] = 1
        cfg["BLOCK_K"] = max(128, int(cfg["BLOCK_K"]) // 128 * 128)
        if cfg.get("SPLIT_K", 1) > 1 and weights.intermediate_size % (cfg["BLOCK_K"] * cfg["SPLIT_K"]):
            cfg["SPLIT_K"] = 1
    cfg["TILED"] = int(bool(cfg.get("TILED")) and _tileable(weights, cfg))
    w = _packed(weights, cfg["TILED"])
    x = layout.hidden
    masked = isinstance(layout, Masked)
    counts = layout.masked_m if masked else layout.counts
    offsets = None if masked else layout.offsets
    max_rows = layout.max_rows if masked else None  # bounded: the slab as a block list
    kind, mma, inter, mma_down = gemm_dtypes(layout.payload, x.dtype, cfg, interpret)
    a_sf = layout.scales
    if a_sf is not None and kind == A_NVFP4:
        a_sf = a_sf.view(torch.uint8)
    if kind == A_FP8:
        x = x.view(torch.uint8)
    a_gs = None
    if kind == A_NVFP4:
        a_gs = layout.global_scale.float().reshape(-1).contiguous()
    H, I = weights.hidden_size, weights.intermediate_size
    lead = x.shape[:-1]
    h = torch.empty(lead + (I,), dtype=inter, device=x.device)
    moe_nvfp4_gemm(x, kind, a_sf, a_gs, w["w13"], w["w13_sf"], w["w13_s2"], h, counts, offsets, masked=masked,
                   n=I, k=H, fuse_silu=True, mma_dtype=mma, cfg=cfg, max_rows=max_rows)
    out_dtype = layout.hidden.dtype if layout.payload == "bf16" else torch.bfloat16
    split = cfg.get("SPLIT_K", 1) > 1
    out = (torch.zeros if split else torch.empty)(lead + (H,), dtype=torch.float32 if split else out_dtype,
                                                  device=x.device)
    moe_nvfp4_gemm(h, A_FLOAT, None, None, w["w2"], w["w2_sf"], w["w2_s2"], out, counts, offsets, masked=masked,
                   n=H, k=I, fuse_silu=False, cfg=cfg, mma_dtype=mma_down, max_rows=max_rows)
    return out.to(out_dtype) if split else out


def _pack(w13, s13, w2, s2, w) -> dict:
    return {"w13": w13.contiguous(), "w13_sf": s13.contiguous().view(torch.uint8),
            "w13_s2": w.w13_weight_scale_2.float().contiguous(),
            "w2": w2.contiguous(), "w2_sf": s2.contiguous().view(torch.uint8),
            "w2_s2": w.w2_weight_scale_2.float().contiguous()}


def _stored(w) -> dict:
    """The stored NVFP4 tensors under the kernels' names, as they are (views: no copy, no kernel)."""
    return _pack(w.w13_weight, w.w13_weight_scale, w.w2_weight, w.w2_weight_scale, w)


def _repack(w) -> dict:
    """The modelopt layout (a copy when the weights are stored tiled)."""
    p = w.plain_nvfp4()
    return _pack(p["w13_weight"], p["w13_weight_scale"], p["w2_weight"], p["w2_weight_scale"], w)


def _repack_tiled(w) -> dict:
    """The tiled layout: the stored tensors when ExpertWeights.tile_ ran, else a tiled copy."""
    if w.nvfp4_tiled:
        return _stored(w)
    plain = _repack(w)
    w13, w13_sf = tile_nvfp4(plain["w13"], plain["w13_sf"])
    w2, w2_sf = tile_nvfp4(plain["w2"], plain["w2_sf"])
    return {**plain, "w13": w13, "w13_sf": w13_sf, "w2": w2, "w2_sf": w2_sf}


def _packed(weights, tiled) -> dict:
    """The kernels' weight tensors in the tiled or the plain layout, built once per ExpertWeights."""
    return weights.prepare("triton_tiled", _repack_tiled) if tiled else weights.prepare("triton", _repack)


def _tileable(weights, cfg: dict) -> bool:
    """The tiled layout fits (`ExpertWeights.can_tile`) and BLOCK_K is a multiple of 128 dividing both K's."""
    H, I, bk = weights.hidden_size, weights.intermediate_size, int(cfg["BLOCK_K"])
    split = max(1, int(cfg.get("SPLIT_K", 1)))
    return weights.can_tile and bk % 128 == 0 and H % bk == 0 and I % (bk * split) == 0


def resolve_config(config: dict, expected_m: int, interpret: bool = False) -> dict:
    """`config` with its auto knobs replaced by `heuristic_config(expected_m)`'s choices: 0 for the
    tile/launch knobs, -1 for DEQ_ASM / PERM_K / DENSE_MIN_M (whose 0 means off)."""
    auto = heuristic_config(expected_m, interpret)
    return {k: (auto.get(k, 0) if v == -1 and k in _AUTO_MINUS1 else auto.get(k, v) if v == 0 and k not in _AUTO_MINUS1
                else v) for k, v in config.items()}


def dense_path_taken(layout, config: dict, expected_m: int) -> bool:
    """Whether run_triton takes the dequantise-then-torch._grouped_mm path for this call."""
    cfg = resolve_config({**_DEFAULT, **config}, expected_m, os.environ.get("TRITON_INTERPRET") == "1")
    return _dense_path(layout, cfg, expected_m)


def _dense_path(layout, cfg: dict, expected_m: int) -> bool:
    m = cfg.get("DENSE_MIN_M", 0)
    return (m > 0 and expected_m >= m and layout.payload == "bf16" and not isinstance(layout, Masked)
            and hasattr(torch, "_grouped_mm") and not capturing())


def frag_path_taken(layout, weights, config: dict) -> bool:
    """Whether run_triton runs the fragment-order Gluon GEMMs (moe/triton/nvfp4_frag.py) for this call: always
    for weights stored in fragment order (`ExpertWeights.frag_`; FRAG is ignored for them), else FRAG 1, or -1
    (auto) unless the weights are stored tiled (at any token count: on an H200 they beat the in-loop kernel from 1
    to 2048 tokens per expert); either layout, any payload; NVFP4 weights with H and I multiples of 128, on an
    sm90 GPU whose Triton has Gluon. Weights not stored in fragment order are read from a fragment-order copy
    built at the first call outside a CUDA graph capture (packing inside one would record the repack into the
    graph): a call captured before any eager one runs the in-loop kernel."""
    from pdlab.moe.triton import nvfp4_frag

    frag = int(config.get("FRAG", -1))
    if weights.nvfp4_frag:
        frag = 1  # their own kernels, whatever a config says (any other kernel would read a copy)
    if frag == 0 or not weights.can_tile:
        return False
    if frag == -1 and weights.nvfp4_tiled:
        # a second copy of experts stored tiled in place (for the in-loop kernel) could exhaust the GPU mid-run
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or nvfp4_frag.available(layout.hidden.device) is not None:
        return False
    return weights.nvfp4_frag or "triton_frag" in weights.prepared or not capturing()


def kernel_path(layout, weights, config: dict) -> str:
    """Which kernels run_triton runs for this call under `config` (the resolved config run_experts passes,
    with its "_expected_m"): "fragment" (the Gluon decode GEMMs), "dense" (dequantise + torch._grouped_mm) or
    "in-loop" (the NVFP4 GEMM of moe/triton/nvfp4_moe.py)."""
    cfg = dict(config)
    expected_m = cfg.pop("_expected_m", 16)
    cfg = resolve_config({**_DEFAULT, **cfg}, expected_m, os.environ.get("TRITON_INTERPRET") == "1")
    return _choose_path(layout, weights, cfg, expected_m)


def _choose_path(layout, weights, cfg: dict, expected_m: int) -> str:
    """run_triton's choice under a resolved config (the one place it is made)."""
    if _dense_path(layout, cfg, expected_m):
        return "dense"
    return "fragment" if frag_path_taken(layout, weights, cfg) else "in-loop"


def _run_frag(layout, weights, cfg: dict, expected_m: int) -> torch.Tensor:
    """Masked slabs or Contiguous rows (float, fp8 or nvfp4 activations, converted to fp16 by a small kernel first)
    through the fragment-order GEMMs (gate_up+SiLU·mul, down); as with the in-loop kernel, rows past an expert's
    count are not written. Programs are FRAG_BM tokens (0: 16 / 32 / 64 by the expected tokens per expert; a slab
    is sized for the worst case, programs past an expert's rows exit at once); FRAG_XASYNC, FRAG_UNROLL, FRAG_RING,
    FRAG_RING_DOWN, FRAG_PAIR_DOWN, FRAG_MAXNREG, FRAG_PDL, FRAG_XRING, FRAG_MMA_ASYNC and FRAG_SLAB_LIST as in the
    module docstring."""
    from pdlab.moe.triton import nvfp4_frag

    packs = weights.prepare("triton_frag", _repack_frag)
    bm = int(cfg.get("FRAG_BM") or program_tokens(expected_m))
    x_async = int(cfg.get("FRAG_XASYNC", -1))
    x_async = bm == 64 if x_async == -1 else bool(x_async)
    unroll = int(cfg.get("FRAG_UNROLL") or (1 if x_async and bm == 64 else 2))
    ring, ring_down, pair = (int(cfg.get(k, -1)) for k in ("FRAG_RING", "FRAG_RING_DOWN", "FRAG_PAIR_DOWN"))
    ring = 2 if ring == -1 else ring
    pair = True if pair == -1 else bool(pair)
    if pair and weights.hidden_size % 256:
        pair = False  # (two 128-row tiles per program need H % 256 == 0)
    ring_down = (2 if pair else 0) if ring_down == -1 else ring_down
    maxnreg = int(cfg.get("FRAG_MAXNREG", 0)) or None
    pdl = int(cfg.get("FRAG_PDL", -1)) == 1  # (-1: off; no gain beyond the runs' noise, see the module docstring)
    x_ring = int(cfg.get("FRAG_XRING", -1)) != 0
    mma_async = int(cfg.get("FRAG_MMA_ASYNC", -1))
    mma_async = default_mma_async(bm, expected_m) if mma_async == -1 else bool(mma_async)
    slab_list = {-1: None, 0: False}.get(int(cfg.get("FRAG_SLAB_LIST", -1)), True)
    out_dtype = layout.hidden.dtype if layout.payload == "bf16" else torch.bfloat16
    return nvfp4_frag.run_frag(layout, packs, weights.intermediate_size, out_dtype, bm, unroll, x_async_down=x_async,
                               ring=ring, ring_down=ring_down, maxnreg=maxnreg, pair_down=pair, pdl=pdl,
                               x_ring=x_ring, mma_async=mma_async, slab_list=slab_list)


def _repack_frag(w) -> dict:
    """The fragment-order NVFP4 experts: the stored tensors when `ExpertWeights.frag_` ran (no copy, no kernel:
    safe inside a CUDA graph capture), else a copy built once per ExpertWeights beside the stored layout."""
    from pdlab.moe.triton import nvfp4_frag

    if w.nvfp4_frag:
        return _stored(w)
    p = w.plain_nvfp4()
    return nvfp4_frag.pack_experts(p["w13_weight"], p["w13_weight_scale"], p["w2_weight"], p["w2_weight_scale"],
                                   w.w13_weight_scale_2, w.w2_weight_scale_2)


_SIDE_STREAMS: dict = {}  # device index → the stream the dense path dequantises on (one per device, reused)


def _side_stream(device: torch.device):
    """The dense path's dequantisation stream on `device` (created once)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def _run_dense(layout, weights, cfg: dict) -> torch.Tensor:
    """Contiguous bf16 rows [N, H]: per chunk of experts, NVFP4 → bf16 weights (one pass), then
    gate_up and down through torch._grouped_mm with SiLU·mul between (as the torch_grouped runner).
    Weights stored tiled or in fragment order are dequantised from that layout (no plain copy).
    On CUDA with DENSE_OVERLAP (default 1) the next chunk is dequantised on a side stream while the current
    chunk's GEMMs run (two weight buffers of DENSE_CHUNK / 2 experts each, so the scratch stays that of one
    DENSE_CHUNK chunk); results are the same bits either way."""
    import torch.nn.functional as F

    from pdlab.moe.triton.nvfp4_dequant import nvfp4_to_bf16

    tiled, frag = weights.nvfp4_tiled, weights.nvfp4_frag
    w = _stored(weights) if frag else _packed(weights, tiled)
    x = layout.hidden
    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    overlap = x.is_cuda and bool(cfg.get("DENSE_OVERLAP", 1))
    chunk = max(1, min(E, int(cfg.get("DENSE_CHUNK", 16))))
    if overlap:
        chunk = max(1, chunk // 2)
    offs = layout.offsets.tolist()  # host read: the row range of each chunk
    chunks = [(e0, min(E, e0 + chunk)) for e0 in range(0, E, chunk) if offs[min(E, e0 + chunk)] > offs[e0]]
    out = torch.empty((x.shape[0], H), dtype=x.dtype, device=x.device)
    nbuf = 2 if overlap and len(chunks) > 1 else 1
    w13 = torch.empty((nbuf, chunk, 2 * I, H), dtype=torch.bfloat16, device=x.device)
    w2 = torch.empty((nbuf, chunk, H, I), dtype=torch.bfloat16, device=x.device)

    def dequantise(j):
        e0, e1 = chunks[j]
        b = j % nbuf
        nvfp4_to_bf16(w["w13"][e0:e1], w["w13_sf"][e0:e1], w["w13_s2"][e0:e1], w13[b, :e1 - e0], tiled=tiled,
                      frag=frag)
        nvfp4_to_bf16(w["w2"][e0:e1], w["w2_sf"][e0:e1], w["w2_s2"][e0:e1], w2[b, :e1 - e0], tiled=tiled, frag=frag)

    def gemms(j):
        e0, e1 = chunks[j]
        b, n = j % nbuf, e1 - e0
        r0, r1 = offs[e0], offs[e1]
        ends = (layout.offsets[e0 + 1:e1 + 1] - r0).to(torch.int32)
        xs = x[r0:r1].to(torch.bfloat16)
        gu = torch._grouped_mm(xs, w13[b, :n].transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)
        g, u = gu.chunk(2, dim=-1)
        out[r0:r1] = torch._grouped_mm(F.silu(g) * u, w2[b, :n].transpose(-2, -1), offs=ends,
                                       out_dtype=torch.bfloat16).to(x.dtype)

    if nbuf == 1:
        for j in range(len(chunks)):
            dequantise(j)
            gemms(j)
        return out
    # two buffers: chunk j + 1 is dequantised (side stream) while chunk j's GEMMs run (main stream); the side stream
    # reuses a buffer only after the GEMMs that read it (chunk j - 1) are done. The main stream waits for every
    # dequantisation it reads, so the buffers (allocated on it) are free for its later work when it frees them.
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)  # the scratch and the inputs as the main stream left them
    ready, done = [None] * len(chunks), [None] * len(chunks)
    with torch.cuda.stream(side):
        dequantise(0)
        ready[0] = side.record_event()
    for j in range(len(chunks)):
        if j + 1 < len(chunks):
            with torch.cuda.stream(side):
                if j >= 1:
                    side.wait_event(done[j - 1])
                dequantise(j + 1)
                ready[j + 1] = side.record_event()
        main.wait_event(ready[j])
        gemms(j)
        done[j] = main.record_event()
    return out
