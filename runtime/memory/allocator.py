"""KV page allocators: which pages of the pool are free. Two implementations, one interface:

- `TokenAllocator`: page size 1 (one slot per token); the free slots are an int64 tensor stack, so
  allocating thousands of slots is one slice, not a Python loop.
- `PagedAllocator`: page size > 1 (or 1); a free list of page ids.

Both implement allocate, free, backup (copy a request's KV rows to CPU) and restore (allocate fresh
pages and copy the rows back). Page 0 is reserved: it is the dummy page that padded rows of a
CUDA-graph batch point at, so it is never handed out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pdlab.runtime.memory.pool import KVBackup, MLAKVPool


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free (callers check `num_free` first)."""


class BaseAllocator(ABC):
    """Hands out page ids in [1, num_pages). `page_size` tokens per page."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved dummy page), got {num_pages}")
        if page_size < 1 or page_size > 128:
            raise ValueError(f"page_size must be in [1, 128], got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._in_use = np.zeros(num_pages, dtype=bool)
        self._in_use[0] = True  # dummy page

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the dummy page)."""
        return self.num_pages - 1

    @property
    @abstractmethod
    def num_free(self) -> int: ...

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """Take n free pages; raise OutOfPages when fewer are free."""

    def free(self, pages: list[int]) -> None:
        """Give pages back; raise ValueError for a page that is not allocated (double free)."""
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        self._mark(idx, False)
        self._release(pages, idx)

    @abstractmethod
    def _release(self, pages: list[int], idx: np.ndarray) -> None:
        """Put checked, unmarked pages (also as an int64 array) back on the free list."""

    def _check_request(self, n: int, free: int, unit: str) -> None:
        if n < 0:
            raise ValueError(f"allocate(n): n must be >= 0, got {n}")
        if n > free:
            raise OutOfPages(f"asked for {n} {unit}, {free} free")

    def backup(self, pool: "MLAKVPool", pages: list[int], num_tokens: int) -> "KVBackup":
        """Copy the KV rows of the first `num_tokens` tokens held in `pages` to CPU. Pages stay allocated."""
        self._check_owned(pages)
        return pool.copy_to_cpu(pages, num_tokens)

    def restore(self, pool: "MLAKVPool", backup: "KVBackup", extra_pages: int = 0) -> list[int]:
        """Allocate pages for a backup (+ extra_pages empty ones after it), copy the rows back, return the ids."""
        pool.check_backup(backup)
        need = -(-backup.num_tokens // self.page_size) + extra_pages
        pages = self.allocate(need)
        pool.copy_from_cpu(pages, backup)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _check_owned(self, pages: list[int]) -> None:
        idx = np.asarray(pages, dtype=np.int64)
        if idx.size and (idx.min() < 1 or idx.max() >= self.num_pages or not self._in_use[idx].all()):
            raise ValueError(f"pages {pages[:8]}... are not all allocated pages of this pool "
                             f"(valid ids 1..{self.num_pages - 1}); a request freed or lost its pages")

    def _mark(self, idx: np.ndarray, in_use: bool) -> None:
        if not in_use:
            if idx.size and (idx.min() < 1 or idx.max() >= self.num_pages):
                raise ValueError(f"free(): page id out of range 1..{self.num_pages - 1}: {idx.tolist()[:8]}")
            if not self._in_use[idx].all() or len(np.unique(idx)) != idx.size:
                raise ValueError(f"free(): double free of pages {idx.tolist()[:8]}...")
        self._in_use[idx] = in_use


class TokenAllocator(BaseAllocator):
    """Slots of a page-size-1 pool, kept as a tensor stack of free ids."""

    def __init__(self, num_pages: int, page_size: int = 1):
        if page_size != 1:
            raise ValueError(f"TokenAllocator manages single-token slots (page_size 1), got page_size "
                             f"{page_size}; use PagedAllocator for larger pages")
        super().__init__(num_pages, 1)
        self._stack = torch.arange(num_pages - 1, 0, -1, dtype=torch.int64)  # top of stack = end
        self._top = num_pages - 1

    @property
    def num_free(self) -> int:
        return self._top

    def allocate(self, n: int) -> list[int]:
        self._check_request(n, self._top, "slots")
        out = self._stack[self._top - n:self._top].flip(0).tolist()
        self._top -= n
        self._mark(np.asarray(out, dtype=np.int64), True)
        return out

    def _release(self, pages: list[int], idx: np.ndarray) -> None:
        n = idx.size
        self._stack[self._top:self._top + n] = torch.from_numpy(idx[::-1].copy())
        self._top += n


class PagedAllocator(BaseAllocator):
    """Pages of any size, kept as a Python free list (lowest ids handed out first)."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        self._check_request(n, len(self._free), "pages")
        if n == 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        self._mark(np.asarray(out, dtype=np.int64), True)
        return out

    def _release(self, pages: list[int], idx: np.ndarray) -> None:
        self._free.extend(reversed(pages))


ALLOCATORS: dict[str, type[BaseAllocator]] = {"token": TokenAllocator, "paged": PagedAllocator}


def create_allocator(num_pages: int, page_size: int, kind: str | None = None) -> BaseAllocator:
    """`kind` None picks "token" for page size 1 and "paged" otherwise."""
    kind = kind or ("token" if page_size == 1 else "paged")
    if kind not in ALLOCATORS:
        raise ValueError(f"unknown allocator {kind!r}; choose one of {sorted(ALLOCATORS)}")
    return ALLOCATORS[kind](num_pages, page_size)
