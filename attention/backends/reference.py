"""`torch` backend: the fp32 reference of every MLA op, on any device. The oracle of the tests and
benchmarks: plain gathers and matmuls per sequence, no tiling, no split-KV (host syncs allowed)."""

from __future__ import annotations

import contextlib

import torch

from pdlab.attention.kv import dequantize_kv_fp8
from pdlab.kernels.registry import register_backend

_OPTIONS = {"page_sizes": tuple(1 << i for i in range(8)), "kv_dtypes": ("bf16", "fp16", "fp32", "fp8"),
            "q_dtypes": ("bf16", "fp16", "fp32")}


def _rows(kv_cache: torch.Tensor, pages: torch.Tensor, n: int, kv_scale, op: str = "mla_decode",
          seq: int = 0) -> torch.Tensor:
    """The first n latent rows of one sequence, fp32 [n, 576]; never touches rows at positions >= n.
    Raises ShapeError for a page id outside the pool among the ceil(n / page) pages the sequence reads (entries
    past them, e.g. -1 padding, are never read)."""
    page, num_pages = kv_cache.shape[1], kv_cache.shape[0]
    used = pages[: (n + page - 1) // page].long()
    bad = ((used < 0) | (used >= num_pages)).nonzero()
    if bad.numel():  # the reference syncs anyway; an unchecked -1 would read the last page
        from pdlab.attention.ops import OPS

        i = int(bad[0, 0])
        OPS[op].require("torch", False, "block_table", f"has page id {int(used[i])} at [{seq}, {i}] (sequence {seq} "
                        f"reads its first {used.numel()} entries)", pages,
                        f"0 <= page id < {num_pages} (the pool's pages) in the pages a sequence reads",
                        "Each sequence's first ceil(seqlen / page_size) entries must name pages of the pool; "
                        "entries past them are never read (padding such as -1 is fine there).")
    rows = kv_cache[used].reshape(-1, kv_cache.shape[-1])[:n]
    return dequantize_kv_fp8(rows, kv_scale) if kv_cache.dtype == torch.uint8 else rows.float()


def _attend(q: torch.Tensor, rows: torch.Tensor, first_pos: int, scale: float, budget: int = 1 << 28):
    """q [n_q, H, 576] fp32 at positions first_pos.., rows [L, 576] → out [n_q, H, 512], lse [n_q, H].
    Long extends go in query chunks so the score matrix stays under `budget` elements."""
    n_q, H, L = q.shape[0], q.shape[1], rows.shape[0]
    chunk = max(1, budget // max(1, H * L))
    if n_q > chunk:
        parts = [_attend(q[i:i + chunk], rows, first_pos + i, scale, budget) for i in range(0, n_q, chunk)]
        return torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])
    with _full_fp32():
        scores = torch.einsum("qhd,ld->qhl", q, rows) * scale
    pos = torch.arange(L, device=q.device)
    limit = first_pos + torch.arange(n_q, device=q.device) + 1
    scores = scores.masked_fill(pos[None, None, :] >= limit[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    with _full_fp32():
        out = torch.einsum("qhl,ld->qhd", torch.softmax(scores, dim=-1), rows[:, :512])
    return out, lse


@contextlib.contextmanager
def _full_fp32():
    """The oracle never uses TF32, whatever the process set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@register_backend("mla_decode", "torch", archs=("cpu", "cuda"), priority=0, options=_OPTIONS, reference=True)
def mla_decode_torch(q, kv_cache, block_table, seqlens, softmax_scale, *, kv_scale=None, config=None):
    """fp32 reference: per sequence, gather its rows, full softmax with the S_q causal mask."""
    B, Sq, H, _ = q.shape
    out = torch.empty(B, Sq, H, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seqlens.tolist()):
        rows = _rows(kv_cache, block_table[b], n, kv_scale, "mla_decode", b)
        o, l = _attend(q[b].float(), rows, n - Sq, softmax_scale)
        out[b] = o.to(q.dtype)
        lse[b] = l.transpose(0, 1)
    return out, lse


@register_backend("mla_prefill", "torch", archs=("cpu", "cuda"), priority=0, options=_OPTIONS, reference=True)
def mla_prefill_torch(q, kv_cache, block_table, seqlens, qo_indptr, softmax_scale, *, kv_scale=None,
                      max_q_len=None, config=None):
    """fp32 reference of the absorbed extend: per sequence, its new tokens against all its rows."""
    T, H, _ = q.shape
    out = torch.empty(T, H, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    ip = qo_indptr.tolist()
    for b, n in enumerate(seqlens.tolist()):
        s, e = ip[b], ip[b + 1]
        if e == s:
            continue
        rows = _rows(kv_cache, block_table[b], n, kv_scale, "mla_prefill", b)
        o, l = _attend(q[s:e].float(), rows, n - (e - s), softmax_scale)
        out[s:e] = o.to(q.dtype)
        lse[s:e] = l
    return out, lse


@register_backend("store_kv", "torch", archs=("cpu", "cuda"), priority=0, options=_OPTIONS, reference=True)
def store_kv_torch(kv_cache, slots, latent, *, kv_scale=None, config=None):
    """Reference scatter; raises on slots outside the pool (-1 skips a row)."""
    from pdlab.attention.kv import quantize_kv_fp8
    from pdlab.attention.ops import STORE_KV

    P, page, _ = kv_cache.shape
    if slots.numel():
        low, top = int(slots.min()), int(slots.max())
        STORE_KV.require("torch", low >= -1, "slots", f"has slot {low}, below the pool", slots,
                         f"-1 <= slots < num_pages*page_size = {P * page}",
                         "A slot is page * page_size + offset; -1 skips a row (padding), no other negative slot.")
        STORE_KV.require("torch", top < P * page, "slots", f"reaches slot {top}, beyond the pool", slots,
                         f"slots < num_pages*page_size = {P * page}", "A slot is page * page_size + offset.")
    keep = slots >= 0
    idx = slots[keep]
    rows = latent[keep]
    if kv_cache.dtype == torch.uint8:
        rows = quantize_kv_fp8(rows, kv_scale)
    kv_cache[idx // page, idx % page] = rows.to(kv_cache.dtype)
