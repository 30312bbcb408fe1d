"""`triton` backend: pdlab's own MLA kernels (attention/triton_kernels.py) on any CUDA GPU.

Decode: split-KV flash-decoding with many heads per program and an lse combine; prefill: the same
kernel over ragged query blocks; store_kv: slot scatter with fp8 quantization. Knobs (config_space)
change speed only: BLOCK_N kv tokens per tile (0 = auto by rows), BLOCK_H heads per program, BLOCK_T query tokens per
program (prefill), num_splits (0 = auto: fill the SMs ~`waves` times), num_warps (0 = auto by rows),
num_stages (software pipelining of the page loads), fp8_compute (fp8 pools: upcast to bf16, or to
fp16 — one conversion instruction instead of several on sm90; q goes to fp16 divided per row by a
power of two that keeps it under 2^14, folded back into the scores, so no q overflows and nothing is
lost: fp16 carries more mantissa bits than bf16; "auto", the default: fp16 for programs of <= 32 rows or
in column quarters, bf16 otherwise — at 128 heads without quarters the fp16 path's per-row q rescaling and
the converted tile cost more registers than the cheaper conversion saves: 2.47 → 1.85 ms at B=128, 8k on an
H200), swap_ab (decode: 1 runs the token-major kernel, K·q^T and V^T·p^T, so
that the KV tile is the MMA's M side — wgmma on sm90 with few heads per program), fp8_reload (fp8
pools with swap_ab: load the V bytes a second time so V is upcast once into a 16-bit shared tile
instead of being gathered byte by byte), tile_in_page (1: when the page size is a multiple of BLOCK_N a
tile lies in one page, so it takes one page id and one 64-bit base instead of one per row — fewer
registers, more programs per SM; 0: per-row page ids), fp8_upcast (fp8 pools with fp16 compute, row-major
kernel, sm89+: "inline" lets Triton convert each dot's operand after its shared-memory read — the fp8 tile
is then read byte by byte and converted twice; "once" converts the loaded tile once with a PTX conversion
so both dots read it as fp16 with ldmatrix, like a bf16 cache — the default, 0.444 against 0.546 ms on an
H200 at B=128, 8k, 16 heads; "prefetch" is "once" with the next tile's bytes loaded into registers while
the current tile is computed, software pipelining that Triton does not do for a tile consumed in registers),
d_quarters (row-major: q, the KV tile and the accumulator in four column quarters of 128, one dot per quarter,
so that a quarter of each is live at a time — 241 → 191 registers for a 16-head program over an fp8 pool; at
<= 32 rows the five q·k products are independent MMA chains summed after, instead of one chain of 36 MMAs),
page_ahead (the page id of the next tile is read one iteration early, so the tile's address no longer waits
on a load of its own iteration and Triton's pipeliner gives the KV tile num_stages - 1 shared buffers
instead of one; it costs shared memory: at 128 heads over a 16-bit cache with 3 stages it does not fit),
q_prescale (fp8 pools in fp16 compute with column quarters: a small kernel divides q per row before the launch,
so the attention kernel loads q per quarter from memory, kept in shared memory, instead of rescaling it into
registers; "auto": on above 32 rows per program — 1181 → 1136 µs at 128 heads, no change at 16:
bench/results/NVIDIA_H200/attention/2026-11-30_q_prescale), kernel (decode over an fp8 pool with heads × S_q ≤ 32 on
sm90: "gluon" runs attention/gluon_mla.py — a cp.async ring, each thread converting the bytes of its own wgmma
fragments, every query row of a sequence in one program, two programs per SM — instead of `_mla_fwd`: 0.384 → 0.193 ms
at B=128, 8k, 16 heads on an H200 — and where 64-row programs hold whole heads (heads × S_q a multiple of 64) over a
contiguous pool of page 64/128, bf16/fp16 or fp8, attention/gluon_mla_wide.py: TMA into a two-tile ring, two
warpgroups, q·k and p·v as wgmma from shared memory — 1.14 → 0.70 ms (256 → 418 TFLOPS) at B=128, 8k, 128 heads bf16;
of the knobs above both read num_splits and waves (0, auto: the split count that fills the SMs best); "auto", the
default, runs one wherever one can; "triton" never), schedule (the fp8 Gluon kernel: "uniform" cuts every sequence
into the same number of splits; "balanced" spreads the KV tiles of the whole batch over one wave of programs by
the actual lengths — a long sequence gets more programs than a short one, gluon_mla.balanced_schedule — and
ignores num_splits and waves; "auto", the default, is balanced from gluon_mla.BALANCED_MIN_BATCH sequences. On an
H200 at 16 heads: 32 sequences of 256–32k tokens 0.179 → 0.121 ms, one 32k sequence among 127 of 1k 0.504 →
0.265 ms, uniform lengths within ±1 % from B=64 (B=32 3–4 % slower): bench/results/NVIDIA_H200/attention/
2026-12-01_fp8_balanced); conv_group (the wide kernel over an fp8 pool: column blocks of a tile converted per
barrier, 1 / 3 / 9; 9, the whole tile, is the default, the fastest at every shape measured); tma3 (the wide kernel:
1, the default, loads a tile's latent as one 3-D TMA box, 0 as eight 2-D boxes: 4–16 % slower at 128 heads);
seesaw (64-row programs over a bf16/fp16 pool: 1, the default, runs attention/gluon_mla_seesaw.py — the two
warpgroups on alternate tiles, each q·k over a whole tile, one's softmax under the other's MMAs — 0 the wide
kernel's shared tiles: 0.612 → 0.516 ms at B=128, 8k, 128 heads bf16 on an H200, 1.12–1.23× from batch 32, equal
at batch 1–8; bench/results/NVIDIA_H200/attention/2026-12-02_seesaw; over an fp8 pool with bf16 queries, where a
split holds more than 32 tiles, attention/gluon_mla_seesaw_fp8.py — q·k as e4m3 wgmma from the ring, each warpgroup
converting its half of V —: 0.805 → 0.698 ms at B=128, 8k, 1.05–1.15× from 3k tokens a split;
bench/results/NVIDIA_H200/attention/2026-12-02_seesaw_fp8).
"auto" (the default of fp8_compute, d_quarters and page_ahead): over an fp8 pool quarters, page ahead and
fp16 compute; over a 16-bit cache neither knob (both slower there: 0.293 → 0.311–0.328 ms at 16 heads).
fp8_dequant (prefill over an fp8 pool): 1 converts the pages the block table names once into a pool of the query
dtype and runs the 16-bit kernel, 0 converts each tile in the kernel (again in every program that reads it); "auto",
the default, 1 for bf16/fp32 queries up to PREFILL_DEQUANT_MAX_TOKENS tokens: 1.68–1.95× faster on an H100 (B8, 2048
new of 6144, 128 heads 141.5 → 78.2 ms; bench/results/NVIDIA_H100_80GB_HBM3/attention/2026-12-06_prefill_fp8_dequant).
"""

from __future__ import annotations

import torch

from pdlab.kernels.registry import register_backend
from pdlab.kernels.tuned import register_adapter

_PAGES = tuple(1 << i for i in range(8))
_DECODE_OPTIONS = {"page_sizes": _PAGES, "kv_dtypes": ("bf16", "fp16", "fp32", "fp8"),
                   "q_dtypes": ("bf16", "fp16", "fp32"), "q_lens": (1, 2, 4, 8)}
_PREFILL_OPTIONS = {k: v for k, v in _DECODE_OPTIONS.items() if k != "q_lens"}

DECODE_SPACE = {"BLOCK_N": [0, 16, 32, 64], "BLOCK_H": [16, 32, 64, 128], "num_splits": [0, 1, 2, 4, 8, 16, 32],
                "waves": [0, 1.0, 2.0, 4.0, 8.0], "num_warps": [0, 4, 8], "num_stages": [1, 2, 3, 4],
                "fp8_compute": ["bf16", "fp16"], "swap_ab": [0, 1], "fp8_reload": [0, 1], "tile_in_page": [1, 0],
                "fp8_upcast": ["inline", "once", "prefetch"], "d_quarters": [0, 1], "page_ahead": [0, 1],
                "q_prescale": [0, 1], "kernel": ["triton", "gluon"],
                "schedule": ["auto", "balanced", "uniform"], "seesaw": [1, 0]}
# Chosen by the sweeps recorded in bench/results/NVIDIA_H200/attention (B=128, seqlen 8192, page 64):
# 3 stages; 16 heads best with ~8 splits (waves 0 = auto: 7.5 for programs of <= 32 rows, i.e. ~8 short
# programs per SM, 2 for bigger ones) and BLOCK_N 32; 128 heads best with 64-head programs, 8 warps and
# BLOCK_N 64 (BLOCK_N 0 = auto: 32 / 64 by the same rows rule); one page id per tile (tile_in_page);
# fp8 pools: the tile converted once, in column quarters with the page id a tile ahead and fp16 compute
# (bench/results/NVIDIA_H200/attention/2026-11-30_fp8_quarters, B=128, 8k: 16 heads 0.419 → 0.360 ms,
# 128 heads 1.649 → 1.196 ms); without quarters fp16 compute only pays at <= 32 rows.
DECODE_DEFAULT = {"BLOCK_N": 0, "BLOCK_H": 64, "num_splits": 0, "waves": 0, "num_warps": 0, "num_stages": 3,
                  "fp8_compute": "auto", "swap_ab": 0, "fp8_reload": 0, "tile_in_page": 1, "fp8_upcast": "once",
                  "d_quarters": "auto", "page_ahead": "auto", "q_prescale": "auto", "kernel": "auto",
                  "schedule": "auto", "conv_group": 9, "tma3": 1, "seesaw": 1}
PREFILL_SPACE = {"BLOCK_N": [16, 32, 64], "BLOCK_H": [16, 32, 64], "BLOCK_T": [1, 2, 4, 8],
                 "num_splits": [0, 1, 2, 4], "waves": [1.0, 2.0], "num_warps": [0, 4, 8], "num_stages": [1, 2, 3],
                 "fp8_compute": ["bf16", "fp16"], "tile_in_page": [1, 0], "fp8_dequant": [1, 0]}
# BLOCK_N 0: by the rows per program (`_warps`), 64 at DeepSeek-R1's 16 and 128 heads (BLOCK_T 4 x BLOCK_H 16 = 64
# rows); it was 32, which `tune attention --op mla_prefill` beat by 1.12-1.48x in all 8 buckets at 128 heads on an H100
# with exactly this change (bench/results/NVIDIA_H100_80GB_HBM3/tuning/2026-12-06_mla_prefill).
# num_splits 0 with waves 1: a launch of fewer programs than SMs splits each sequence's KV as far as the programs still
# fit in one wave (`auto_splits(within=True)`), others run unsplit; it was 1 (never split), which the tuner beat by
# 1.59x with 2 splits on one prompt of 256 new tokens over a 4096-token prefix at 16 heads (64 programs) on an H100,
# while splitting lost wherever the programs already filled the GPU (bench/results/NVIDIA_H100_80GB_HBM3/tuning/
# 2026-12-06_mla_prefill_16h)
# fp8_dequant "auto": over an fp8 pool with bf16/fp32 queries, the block table's pages are dequantised once into a
# pool of the query dtype (`triton_kernels.dequantize_pages`) where that copy holds at most PREFILL_DEQUANT_MAX_TOKENS
# tokens, and the 16-bit kernel reads it: converting in the kernel repeats the conversion in every program that reads a
# tile (each query block and head block)
PREFILL_DEFAULT = {"BLOCK_N": 0, "BLOCK_H": 16, "BLOCK_T": 4, "num_splits": 0, "waves": 1.0, "num_warps": 0,
                   "num_stages": 2, "fp8_compute": "fp16", "tile_in_page": 1, "fp8_dequant": "auto"}
PREFILL_DEQUANT_MAX_TOKENS = 1 << 18  # 256k tokens: a 302 MB bf16 copy at most


def _probe() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (kernel logic is tested on CPU under TRITON_INTERPRET=1)"
    return None


def _warps(config: dict, rows: int, fp8: bool = False) -> dict:
    """Resolve the auto knobs from the rows per program (<= 32 / more): warps 4 / 8, waves 7.5 / 2,
    BLOCK_N 32 / 64; and from the cache dtype: d_quarters and page_ahead on for an fp8 pool, off otherwise;
    fp8_compute fp16 when the program has <= 32 rows or runs in quarters, bf16 otherwise."""
    cfg = dict(config)
    for knob in ("d_quarters", "page_ahead"):
        if cfg.get(knob, 0) == "auto":
            cfg[knob] = int(fp8)
    if cfg.get("q_prescale", 0) == "auto":
        cfg["q_prescale"] = int(fp8 and rows > 32)
    if cfg.get("fp8_compute", "auto") == "auto":
        cfg["fp8_compute"] = "fp16" if rows <= 32 or int(cfg.get("d_quarters", 0)) else "bf16"
    if not int(cfg.get("BLOCK_N") or 0):
        cfg["BLOCK_N"] = 32 if rows <= 32 else 64
    if not int(cfg.get("num_warps") or 0):
        cfg["num_warps"] = 4 if rows <= 32 else 8
    if not float(cfg.get("waves") or 0) and cfg.get("kernel", "triton") == "triton":
        # (a decode that may run a Gluon kernel keeps 0: the launcher picks the splits by the kernel it runs)
        cfg["waves"] = 7.5 if rows <= 32 else 2.0
    return cfg


def resolve_decode_config(config: dict, heads: int, q_len: int, fp8: bool = False) -> dict:
    """The decode config with its auto knobs resolved for programs of min(BLOCK_H, pow2(q_len)·heads)
    rows over a bf16/fp16/fp32 or (fp8) an fp8 pool: what `mla_decode_triton` runs; the tuner starts its
    search from it."""
    from pdlab.attention import triton_kernels as tk

    return _warps(config, min(int(config["BLOCK_H"]), tk._pow2_at_least(q_len) * heads), fp8)


DECODE_KERNELS = {"fp8": "gluon_mla", "wide": "gluon_mla_wide", "seesaw": "gluon_mla_seesaw", None: "_mla_fwd"}


def decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, config: dict | None = None,
                  block_table: torch.Tensor | None = None) -> str:
    """Which kernel `mla_decode_triton` runs for q [B, S_q, H, 576] over kv_cache [P, page, 576] (uint8 for fp8) with
    `config` (merged over the default; None: the default) and block_table [B, max_pages] int32 (its width sets the
    split count; None: a long pool): "gluon_mla" (fp8, ≤ 32 query rows, sm90), "gluon_mla_seesaw" (64-row programs
    over a 16-bit pool, sm90, seesaw on), "gluon_mla_seesaw_fp8" (those over fp8 where the splits are long),
    "gluon_mla_wide" (the other 64-row programs) or "_mla_fwd". What `bench attention` prints beside each row."""
    from pdlab.attention import triton_kernels as tk

    B, Sq, H, _ = q.shape
    fp8 = kv_cache.dtype == torch.uint8
    cfg = resolve_decode_config({**DECODE_DEFAULT, **(config or {})}, H, Sq, fp8)
    capacity = None if block_table is None else block_table.shape[1] * kv_cache.shape[1]
    name = DECODE_KERNELS[tk._gluon_kernel(cfg, fp8, Sq, H, q.reshape(B * Sq, H, 576), kv_cache, B, capacity)]
    return name + "_fp8" if fp8 and name == "gluon_mla_seesaw" else name


def carry_splits(config: dict, tuned: dict, call: dict) -> dict:
    """A decode config tuned at bucket `tuned` carried over to a call at bucket `call` (the tuned store's adapter for
    mla_decode[triton]): an explicit num_splits sets how many programs fill the GPU (batch × splits), so it is
    scaled by tuned batch / call batch (rounded down, 1–64) — the B=128 8k entry's 2 splits run B=64 8k with 4,
    not with 128 programs on 132 SMs (0.223 ms, 2.7 TB/s, on an H200). num_splits 0 (automatic) stays."""
    splits, tb, cb = int(config.get("num_splits") or 0), int(tuned.get("batch", 0)), int(call.get("batch", 0))
    if splits > 0 and tb > 0 and cb > 0:
        config["num_splits"] = max(1, min(64, splits * tb // cb))
    return config


@register_backend("mla_decode", "triton", archs=("cuda",), packages=("triton",), probe=_probe, priority=50,
                  config_space=DECODE_SPACE, default_config=DECODE_DEFAULT, options=_DECODE_OPTIONS)
def mla_decode_triton(q, kv_cache, block_table, seqlens, softmax_scale, *, kv_scale=None, config=None):
    """Split-KV flash-decoding over the paged latent cache (bf16/fp16/fp32 or fp8 bytes)."""
    from pdlab.attention import triton_kernels as tk

    B, Sq, H, _ = q.shape
    out = torch.empty(B, Sq, H, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    cfg = config or DECODE_DEFAULT
    cfg = resolve_decode_config(cfg, H, Sq, kv_cache.dtype == torch.uint8)
    tk.mla_attention(q.reshape(B * Sq, H, 576), kv_cache, block_table, seqlens, None, out.view(B * Sq, H, 512),
                     lse, (H, 1, Sq), softmax_scale, kv_scale, q_per_seq=Sq, q_blocks=1, config=cfg)
    return out, lse


def _dequant_first(config: dict, q_dtype: torch.dtype, block_table: torch.Tensor, page: int) -> bool:
    """Whether a prefill over an fp8 pool dequantises the block table's pages first (knob fp8_dequant: 1, 0 or "auto",
    which caps the copy at PREFILL_DEQUANT_MAX_TOKENS). Only bf16/fp32 queries: e4m3 · kv_scale may overflow fp16."""
    if q_dtype not in (torch.bfloat16, torch.float32):
        return False
    knob = config.get("fp8_dequant", "auto")
    if knob == "auto":
        return block_table.numel() * page <= PREFILL_DEQUANT_MAX_TOKENS
    return bool(int(knob))


@register_backend("mla_prefill", "triton", archs=("cuda",), packages=("triton",), probe=_probe, priority=50,
                  config_space=PREFILL_SPACE, default_config=PREFILL_DEFAULT, options=_PREFILL_OPTIONS)
def mla_prefill_triton(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, *, kv_scale=None,
                       max_q_len=None, config=None):
    """Absorbed causal extend over the paged cache, ragged query blocks (grid sized by max_q_len, no sync)."""
    from pdlab.attention import triton_kernels as tk

    T, H, _ = q.shape
    out = torch.empty(T, H, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or seqlens.shape[0] == 0:
        return out, lse
    cfg = config or PREFILL_DEFAULT
    if kv_cache.dtype == torch.uint8 and _dequant_first(cfg, q.dtype, block_table, kv_cache.shape[1]):
        kv_cache, block_table = tk.dequantize_pages(kv_cache, block_table, kv_scale, q.dtype)
        kv_scale = None
    block_t = int(cfg.get("BLOCK_T", 1))
    cfg = _warps(cfg, block_t * min(int(cfg["BLOCK_H"]), H), kv_cache.dtype == torch.uint8)
    q_blocks = -(-int(max_q_len if max_q_len is not None else T) // block_t)
    tk.mla_attention(q, kv_cache, block_table, seqlens, qo_indptr, out, lse, (lse.stride(0), lse.stride(0), 1),
                     softmax_scale, kv_scale, q_per_seq=0, q_blocks=q_blocks, config=cfg)
    return out, lse


@register_backend("store_kv", "triton", archs=("cuda",), packages=("triton",), probe=_probe, priority=50,
                  options={"page_sizes": _PAGES, "kv_dtypes": ("bf16", "fp16", "fp32", "fp8")})
def store_kv_triton(kv_cache, slots, latent, *, kv_scale=None, config=None):
    """One program per row; slots < 0 or beyond the pool are skipped."""
    from pdlab.attention import triton_kernels as tk

    tk.store_kv(kv_cache, slots, latent, kv_scale)


register_adapter("mla_decode", "triton", carry_splits)
