"""`tune attention`: MLA decode (and prefill) buckets at a model's shapes, inputs built for the public
ops `pdlab.attention.mla_decode` / `mla_prefill`.

Buckets (the keys the ops pass to `resolve_config`):
- mla_decode: batch {1, 8, 32, 64, 128, 256} × seqlen {1024, 4096, 8192, 16384} × heads {H/8 (TP8), H}
  × kv_dtype {bf16, fp8}, q_len 1, page 64. seqlen = pages per sequence × page size.
- mla_prefill: batch {1, 8} × q_len (new tokens per sequence) {256, 2048} × seqlen (cached prefix + new)
  {q_len, q_len + 4096} × heads {H/8, H}, bf16 cache.
"""

from __future__ import annotations

import argparse

import torch

from pdlab.bench.harness import cosine_error
from pdlab.tuning.command import add_common_arguments, run_tune
from pdlab.tuning.models import ModelShape
from pdlab.tuning.target import TuneTarget, product, register_target

PAGE = 64
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_SEQLENS = (1024, 4096, 8192, 16384)
KV_DTYPES = ("bf16", "fp8")


def head_counts(model: ModelShape) -> list[int]:
    """Heads per GPU at TP8 and TP1 (16 and 128 for DeepSeek-R1)."""
    return sorted({max(1, model.num_heads // 8), model.num_heads})


def decode_buckets(model: ModelShape) -> list[dict]:
    return product({"batch": DECODE_BATCHES, "seqlen": DECODE_SEQLENS, "heads": head_counts(model),
                    "kv_dtype": KV_DTYPES, "q_len": (1,)})


def prefill_buckets(model: ModelShape) -> list[dict]:
    out = []
    for b in product({"batch": (1, 8), "q_len": (256, 2048), "prefix": (0, 4096), "heads": head_counts(model),
                      "kv_dtype": ("bf16",)}):
        prefix = b.pop("prefix")
        out.append({**b, "seqlen": b["q_len"] + prefix})
    return out


class AttentionInputs:
    """Tensors of one bucket: q, a paged cache (bf16, or fp8 bytes + kv_scale), block table, seqlens."""

    def __init__(self, bucket: dict, model: ModelShape, device: torch.device, prefill: bool) -> None:
        g = torch.Generator(device=device).manual_seed(1234)
        B, H, S = bucket["batch"], bucket["heads"], bucket["seqlen"]
        D = model.latent_dim
        pages_per_seq = -(-S // PAGE)
        P = B * pages_per_seq
        kv = torch.randn(P, PAGE, D, generator=g, device=device, dtype=torch.bfloat16)
        self.kv_scale = None
        if bucket.get("kv_dtype") == "fp8":
            from pdlab.attention import quantize_kv_fp8

            self.kv_scale = float(kv.float().abs().amax()) / 448.0
            kv = quantize_kv_fp8(kv, self.kv_scale)
        self.kv_cache = kv
        self.block_table = torch.randperm(P, generator=g, device=device).view(B, pages_per_seq).to(torch.int32)
        self.seqlens = torch.full((B,), S, dtype=torch.int32, device=device)
        self.softmax_scale = model.softmax_scale
        if prefill:
            n = bucket["q_len"]
            self.q = torch.randn(B * n, H, D, generator=g, device=device, dtype=torch.bfloat16)
            self.qo_indptr = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)
            self.max_q_len = n
        else:
            self.q = torch.randn(B, bucket.get("q_len", 1), H, D, generator=g, device=device,
                                 dtype=torch.bfloat16)


# Served shapes a decode bucket's tuned config also meets (the store hands it to the nearest shape): short
# and ragged sequences, page-boundary lengths and a lone sequence, in a 512-token block table.
EDGE_LENS = ([1, 17, 63, 64, 65, 80, 81, 130, 300, 511], [80])


def decode_edge_inputs(bucket: dict, model: ModelShape, device: torch.device) -> list:
    """Inputs at served shapes for this bucket's heads and cache dtype (EDGE_LENS): ragged decode problems of
    `pdlab.attention.workloads` (rows past each length are NaN, so a kernel that reads them fails the check).
    The winner of the bucket must match the reference on these too before it is stored."""
    from pdlab.attention.workloads import decode_problem

    out = []
    for n, lens in enumerate(EDGE_LENS):
        p = decode_problem(list(lens), bucket["heads"], bucket.get("q_len", 1), PAGE, torch.bfloat16,
                           kv_dtype=bucket.get("kv_dtype", "bf16"), device=device, capacity=512, seed=1234 + n)
        p.softmax_scale = model.softmax_scale
        out.append(p)
    return out


def _accepts(backend, bucket) -> bool:
    opts = backend.options or {}
    kv = opts.get("kv_dtypes")
    if kv is not None and bucket.get("kv_dtype") not in kv:
        return False
    pages = opts.get("page_sizes")
    if pages is not None and PAGE not in pages:
        return False
    q_lens = opts.get("q_lens")
    return not (q_lens is not None and "batch" in bucket and bucket.get("q_len", 1) not in q_lens
                and backend.op == "mla_decode")


def _call_decode(backend: str, cfg: dict, x: AttentionInputs):
    from pdlab.attention import mla_decode

    return mla_decode(x.q, x.kv_cache, x.block_table, x.seqlens, x.softmax_scale, kv_scale=x.kv_scale,
                      backend=backend, config=cfg)


def _call_prefill(backend: str, cfg: dict, x: AttentionInputs):
    from pdlab.attention import mla_prefill

    return mla_prefill(x.q, x.kv_cache, x.block_table, x.seqlens, x.qo_indptr, x.softmax_scale, kv_scale=x.kv_scale,
                       max_q_len=x.max_q_len, backend=backend, config=cfg)


def _error(out, ref) -> float:
    """Worse of FlashMLA's cosine measure on out and on lse."""
    return max(cosine_error(out[0], ref[0]), cosine_error(out[1], ref[1]))


def _tolerance(bucket) -> float:
    # FlashMLA's bar for bf16; the fp8 cache holds the same bytes for every backend, so only the
    # arithmetic differs, with a little more rounding in the dequantised products.
    return 1e-5 if bucket.get("kv_dtype", "bf16") == "bf16" else 2e-5


def _resolve_decode(backend: str, config: dict, bucket) -> dict:
    """The triton decode kernel's auto knobs (num_warps, waves, BLOCK_N, fp8_compute, d_quarters, page_ahead) as
    it resolves them for this bucket."""
    if backend != "triton":
        return dict(config)
    from pdlab.attention.backends.triton_mla import resolve_decode_config

    return resolve_decode_config(dict(config), int(bucket["heads"]), int(bucket.get("q_len", 1)),
                                 bucket.get("kv_dtype", "bf16") == "fp8")


def _decode_space(backend, bucket, arch: str) -> dict | None:
    """On sm90 with a Triton that has Gluon, a bucket that a Gluon kernel takes runs it by default: over an fp8 pool
    with heads × q_len ≤ 32 attention/gluon_mla.py, over a bf16/fp16/fp8 pool in programs of 64 query rows
    attention/gluon_mla_wide.py. The search is then the kernel (gluon or triton) and the split knobs both Gluon
    kernels read, and the 64-row programs' schedule (`seesaw`: attention/gluon_mla_seesaw.py, over fp8
    gluon_mla_seesaw_fp8.py where its splits are long enough); the other knobs change only `_mla_fwd`, which keeps
    its defaults there. Elsewhere the whole space but `kernel`, `schedule` and `seesaw` (only `_mla_fwd` can run
    there). The fp8 kernel's schedule is not searched (the
    buckets' uniform lengths cannot show what the balanced one is for, ragged batches): from BALANCED_MIN_BATCH
    sequences it takes the split counts from the lengths, and only the kernel is searched there."""
    if backend.name != "triton":
        return None
    import torch

    from pdlab.attention import gluon_mla, gluon_mla_wide

    full = backend.config_space
    heads, q_len, kv = int(bucket["heads"]), int(bucket.get("q_len", 1)), bucket.get("kv_dtype", "bf16")
    if arch == "sm90" and gluon_mla.HAVE_GLUON:
        if gluon_mla.unfit(heads, q_len, kv == "fp8") is None:
            if int(bucket["batch"]) >= gluon_mla.BALANCED_MIN_BATCH:  # schedule auto: balanced, the splits its own
                return {k: full[k] for k in ("kernel",)}
            return {k: full[k] for k in ("kernel", "num_splits", "waves")}
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}.get(kv)
        q_dt = torch.bfloat16 if kv == "fp8" else dt
        if dt is not None and gluon_mla_wide.unfit(heads, q_len, dt, q_dt, 64) is None:
            return {k: full[k] for k in ("kernel", "num_splits", "waves", "seesaw")}
    return {k: v for k, v in full.items() if k not in ("kernel", "schedule", "seesaw")}


def _prefill_space(backend, bucket, arch: str) -> dict | None:
    """The triton prefill knobs that change its speed on this bucket: `fp8_compute` and `fp8_dequant` only over an
    fp8 pool (a 16-bit cache never reads them), `waves` only where num_splits can be 0 (automatic), the one case it
    sizes the splits, and BLOCK_H up to the bucket's heads (a program never holds more heads than there are: at 16
    heads BLOCK_H 16, 32 and 64 are one launch). The other backends: their whole space."""
    if backend.name != "triton":
        return None
    space = dict(backend.config_space)
    if bucket.get("kv_dtype", "bf16") != "fp8":
        space.pop("fp8_compute", None)
        space.pop("fp8_dequant", None)
    if all(int(v) > 0 for v in space.get("num_splits", [0])):
        space.pop("waves", None)
    heads = int(bucket.get("heads", 0) or 0)
    if heads and "BLOCK_H" in space:
        fits = [v for v in space["BLOCK_H"] if int(v) <= heads]
        space["BLOCK_H"] = fits or [min(space["BLOCK_H"])]
    return space


MLA_DECODE = register_target(TuneTarget(
    op="mla_decode", description="MLA decode over the paged latent cache",
    buckets=decode_buckets, build=lambda b, m, d: AttentionInputs(b, m, d, prefill=False), call=_call_decode,
    error=_error, tolerance=_tolerance, accepts=_accepts, modules=("pdlab.attention",), cuda_graph=True,
    resolve=_resolve_decode, edge_inputs=decode_edge_inputs, space=_decode_space,
    bucket_doc="batch × seqlen × heads × kv_dtype, q_len 1, page 64"))

MLA_PREFILL = register_target(TuneTarget(
    op="mla_prefill", description="MLA extend/prefill over the paged latent cache",
    buckets=prefill_buckets, build=lambda b, m, d: AttentionInputs(b, m, d, prefill=True), call=_call_prefill,
    error=_error, tolerance=_tolerance, accepts=_accepts, modules=("pdlab.attention",), space=_prefill_space,
    bucket_doc="batch × q_len (new tokens per sequence) × seqlen (prefix + new) × heads, bf16 cache, page 64"))

OPS = ("mla_decode", "mla_prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, OPS, "mla_decode")


def run(args: argparse.Namespace) -> int:
    return run_tune("tune attention", args, OPS)
