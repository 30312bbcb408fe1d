"""Paged MLA KV pool: per layer one buffer [num_pages, page_size, 576] (bf16, or fp8_e4m3 stored as
uint8 bytes with one per-tensor dequant scale), plus the allocator that owns its free pages.

The pool implements allocate / free / backup / restore by delegating page bookkeeping to its
allocator and doing the copies itself: backups go to CPU (pinned when the pool is on CUDA) in chunks
of `copy_chunk_pages` pages, so a large backup never needs a second full-size buffer on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdlab.kernels.env import ENV
from pdlab.runtime.memory.allocator import BaseAllocator, create_allocator
from pdlab.runtime.memory.prefix_cache import PrefixCache

LATENT_DIM = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}


@dataclass
class KVBackup:
    """CPU copy of one request's KV. layers: per layer [n_pages, page_size, 576] (pool storage dtype,
    pinned when the pool is on CUDA); num_tokens: valid rows (the last page may be partly used)."""

    layers: list[torch.Tensor]
    num_tokens: int
    page_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)


class MLAKVPool:
    """KV pool of `num_layers` layers. kv_caches[l]: [num_pages, page_size, 576] (dtype per kv_dtype);
    kv_scale: float dequant scale for "fp8" (value = e4m3(byte) * kv_scale), None otherwise."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_dtype: str = "bf16",
                 device: str | torch.device = "cpu", *, kv_scale: float | None = None,
                 allocator: str | None = None, copy_chunk_pages: int = 256):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        self.allocator: BaseAllocator = create_allocator(num_pages, page_size, allocator)
        self.kv_scale = (1.0 if kv_scale is None else float(kv_scale)) if kv_dtype == "fp8" else None
        self.copy_chunk_pages = max(1, copy_chunk_pages)
        self.prefix_cache: PrefixCache | None = None  # `enable_prefix_cache()`
        storage = KV_DTYPES[kv_dtype]
        self.kv_caches = [torch.zeros(num_pages, page_size, LATENT_DIM, dtype=storage, device=self.device)
                          for _ in range(num_layers)]

    # ---- sizes -------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(num_layers: int, kv_dtype: str) -> int:
        return num_layers * LATENT_DIM * torch.empty((), dtype=KV_DTYPES[kv_dtype]).element_size()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: the free ones and the cached ones no request reads (evicted on demand)."""
        cache = self.prefix_cache
        return self.allocator.num_free + (cache.evictable if cache is not None else 0)

    @property
    def usage(self) -> float:
        """Fraction of allocatable pages in use by requests, in [0, 1] (cached pages no request reads count as
        free)."""
        cap = self.allocator.capacity
        return (cap - self.num_free_pages) / cap

    def enable_prefix_cache(self) -> PrefixCache:
        """Keep the KV pages of finished requests for reuse by later requests with the same prefix (see
        `prefix_cache.py`); returns the cache."""
        if self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.free, self.page_size)
        return self.prefix_cache

    @property
    def max_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    # ---- allocate / free / backup / restore ----------------------------------------------------
    def allocate(self, n_pages: int) -> list[int]:
        self._make_room(n_pages)
        return self.allocator.allocate(n_pages)

    def _make_room(self, n_pages: int) -> None:
        """Evict cached pages no request reads until `n_pages` are free in the allocator (as far as they go)."""
        short = n_pages - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)

    def free(self, pages: list[int]) -> None:
        self.allocator.free(pages)
        if pages and ENV.check_invariants:  # poison freed pages so stale reads show up in outputs
            idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
            for cache in self.kv_caches:
                cache.index_fill_(0, idx, 0x52 if cache.dtype == torch.uint8 else 7.0)

    def release_pages(self, req, keep: bool = True) -> None:
        """Take back all of `req`'s pages (req.pages: [int]): freed, or with a prefix cache, its full computed pages
        cached when `keep` (false: a failed step may have left them wrong) and its shared ones released."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(req, keep)
        else:
            self.free(req.pages)
            req.pages = []

    def backup(self, pages: list[int], num_tokens: int) -> KVBackup:
        return self.allocator.backup(self, pages, num_tokens)

    def restore(self, backup: KVBackup, extra_pages: int = 0) -> list[int]:
        self._make_room(-(-backup.num_tokens // self.page_size) + extra_pages)
        return self.allocator.restore(self, backup, extra_pages)

    # ---- copies (used by the allocators) ----------------------------------------------------------
    def copy_to_cpu(self, pages: list[int], num_tokens: int) -> KVBackup:
        n_pages = -(-num_tokens // self.page_size)
        if n_pages > len(pages):
            raise ValueError(f"backup of {num_tokens} tokens needs {n_pages} pages, the request holds {len(pages)}")
        pages = pages[:n_pages]
        pin = self.device.type == "cuda"
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        layers = []
        for cache in self.kv_caches:
            dst = torch.empty((n_pages, self.page_size, LATENT_DIM), dtype=cache.dtype, pin_memory=pin)
            for s in range(0, n_pages, self.copy_chunk_pages):
                e = min(n_pages, s + self.copy_chunk_pages)
                dst[s:e].copy_(cache.index_select(0, idx[s:e]), non_blocking=pin)
            layers.append(dst)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()  # the CPU copy must be complete before pages are reused
        return KVBackup(layers, num_tokens, self.page_size, self.kv_caches[0].dtype)

    def check_backup(self, backup: KVBackup) -> None:
        if backup.page_size != self.page_size or backup.dtype != self.kv_caches[0].dtype:
            raise ValueError(f"backup has page_size {backup.page_size} / {backup.dtype}, the pool "
                             f"{self.page_size} / {self.kv_caches[0].dtype}; restore into a matching pool")

    def copy_from_cpu(self, pages: list[int], backup: KVBackup) -> None:
        self.check_backup(backup)
        n_pages = backup.layers[0].shape[0]
        if len(pages) < n_pages:
            raise ValueError(f"restore needs {n_pages} pages, got {len(pages)}")
        idx = torch.tensor(pages[:n_pages], dtype=torch.int64, device=self.device)
        for cache, src in zip(self.kv_caches, backup.layers):
            for s in range(0, n_pages, self.copy_chunk_pages):
                e = min(n_pages, s + self.copy_chunk_pages)
                cache.index_copy_(0, idx[s:e], src[s:e].to(self.device, non_blocking=True))
