"""Random MLA problems over a paged latent cache, shared by tests, `bench attention` and the tuner.

Pages are handed out in a shuffled order (so the block table matters), every sequence owns
`ceil(capacity / page)` pages, and rows at positions >= seqlen can be poisoned with NaN so that a
kernel reading them shows up in its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdlab.attention.kv import quantize_kv_fp8


@dataclass
class Problem:
    """q: decode [B, S_q, H, 576] or prefill [T, H, 576]; kv_cache [P, page, 576]; block_table [B, pages]
    int32; seqlens [B] int32; qo_indptr [B+1] int32 (prefill) or None; kv_scale for fp8 pools."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor
    qo_indptr: torch.Tensor | None
    kv_scale: float | None
    softmax_scale: float
    max_q_len: int

    @property
    def total_kv(self) -> int:
        return int(self.seqlens.sum())


def _generator(device, seed: int | None) -> torch.Generator | None:
    """A generator on the problem's device (data is drawn where it lives: no host-side gigabytes)."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _pool(seqlens: list[int], page: int, dtype: torch.dtype, device, capacity: int | None, poison: bool,
          fp8: bool, gen: torch.Generator | None, spare_pages: int = 3):
    B = len(seqlens)
    cap = capacity or max(seqlens)
    pages = -(-cap // page)
    P = B * pages + spare_pages
    latent = torch.randn(P, page, 576, generator=gen, dtype=torch.float32, device=device)
    order = torch.randperm(P, generator=gen, device=device)[: B * pages].view(B, pages).to(torch.int32)
    kv_scale = None
    if fp8:
        kv_scale = float(latent.abs().max()) / 448.0
        kv = quantize_kv_fp8(latent, kv_scale)
    else:
        kv = latent.to(dtype)
    if poison:  # every row at a position >= its sequence's length becomes NaN (0x7F is NaN in e4m3)
        pos = torch.arange(pages * page, device=device)
        lens = torch.tensor(seqlens, device=device)
        dead = pos[None, :] >= lens[:, None]
        pg = order.long().repeat_interleave(page, dim=1)[dead]
        kv[pg, (pos % page).expand(B, -1)[dead]] = 0x7F if fp8 else float("nan")
    return kv, order, kv_scale


def decode_problem(seqlens: list[int], heads: int, q_len: int = 1, page: int = 64, dtype=torch.bfloat16,
                   kv_dtype: str = "same", device="cpu", capacity: int | None = None, poison: bool = True,
                   seed: int | None = None) -> Problem:
    """A decode batch: len(seqlens) sequences, each with `q_len` new tokens (seqlens include them)."""
    gen = _generator(device, seed)
    kv, table, kv_scale = _pool(seqlens, page, dtype, device, capacity, poison, kv_dtype == "fp8", gen)
    q = torch.randn(len(seqlens), q_len, heads, 576, generator=gen, device=device).to(dtype)
    return Problem(q, kv, table, torch.tensor(seqlens, dtype=torch.int32, device=device), None, kv_scale,
                   576 ** -0.5, q_len)


def prefill_problem(seqlens: list[int], new_tokens: list[int], heads: int, page: int = 64, dtype=torch.bfloat16,
                    kv_dtype: str = "same", device="cpu", capacity: int | None = None, poison: bool = True,
                    seed: int | None = None) -> Problem:
    """An extend batch: sequence b has seqlens[b] tokens of which the last new_tokens[b] are new."""
    assert all(0 <= n <= s for n, s in zip(new_tokens, seqlens)), "new tokens must fit in seqlens"
    gen = _generator(device, seed)
    kv, table, kv_scale = _pool(seqlens, page, dtype, device, capacity, poison, kv_dtype == "fp8", gen)
    T = sum(new_tokens)
    q = torch.randn(T, heads, 576, generator=gen, device=device).to(dtype)
    indptr = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return Problem(q, kv, table, torch.tensor(seqlens, dtype=torch.int32, device=device), indptr, kv_scale,
                   576 ** -0.5, max(new_tokens) if new_tokens else 1)


def decode_cost(batch: int, q_len: int, heads: int, total_kv: int, elem_bytes: float, q_elem_bytes: float = 2.0):
    """(FLOPs, bytes) of one decode call by FlashMLA's benchmark formulas: FLOPs = 2·s_q·Σseqlen·h·(576+512);
    bytes = Σseqlen·576·kv_elem + b·s_q·h·(576+512)·q_elem."""
    flops = 2 * q_len * total_kv * heads * (576 + 512)
    nbytes = total_kv * 576 * elem_bytes + batch * q_len * heads * (576 + 512) * q_elem_bytes
    return flops, nbytes


def prefill_cost(seqlens: list[int], new_tokens: list[int], heads: int, elem_bytes: float, q_elem_bytes: float = 2.0):
    """(FLOPs, bytes) of one absorbed extend call: each new token j of a sequence with prefix p sees
    p + j + 1 rows; FLOPs = 2·h·(576+512)·Σ visible rows; bytes = Σseqlen·576·kv + T·h·(576+512)·q."""
    visible = sum(n * (s - n) + n * (n + 1) // 2 for s, n in zip(seqlens, new_tokens))
    flops = 2 * heads * (576 + 512) * visible
    nbytes = sum(seqlens) * 576 * elem_bytes + sum(new_tokens) * heads * (576 + 512) * q_elem_bytes
    return flops, nbytes
