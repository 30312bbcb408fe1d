"""KV memory contract: every allocator x dtype x page size implements allocate / free / backup /
restore, and a backup restored into fresh pages is byte-identical."""

import inspect

import pytest
import torch

from pdlab.runtime.memory.allocator import ALLOCATORS, BaseAllocator, OutOfPages, create_allocator
from pdlab.runtime.memory.pool import MLAKVPool

METHODS = ("allocate", "free", "backup", "restore")
COMBOS = [(a, d, p) for a in sorted(ALLOCATORS) for d in ("bf16", "fp8") for p in (1, 16, 64)]


def test_every_allocator_and_the_pool_implement_the_contract():
    for cls in list(ALLOCATORS.values()) + [MLAKVPool]:
        for m in METHODS:
            fn = getattr(cls, m, None)
            assert callable(fn), f"{cls.__name__} lacks {m}"
            assert not getattr(fn, "__isabstractmethod__", False), f"{cls.__name__}.{m} is abstract"
        if cls is not MLAKVPool:
            assert issubclass(cls, BaseAllocator) and not inspect.isabstract(cls)


@pytest.mark.parametrize("kind,dtype,page", COMBOS, ids=[f"{a}-{d}-p{p}" for a, d, p in COMBOS])
def test_allocate_free_backup_restore(kind, dtype, page, seed):
    if kind == "token" and page != 1:
        with pytest.raises(ValueError, match="page_size 1"):
            create_allocator(8, page, kind)
        return
    pool = MLAKVPool(num_layers=2, num_pages=12, page_size=page, kv_dtype=dtype, allocator=kind,
                     copy_chunk_pages=2)
    assert type(pool.allocator) is ALLOCATORS[kind]
    cap = pool.allocator.capacity
    assert cap == 11 and pool.num_free_pages == 11
    a = pool.allocate(5)
    assert len(set(a)) == 5 and 0 not in a and pool.num_free_pages == 6
    ntok = 4 * page + max(1, page // 2) if page > 1 else 5
    ntok = min(ntok, 5 * page)
    # distinct content per layer and row
    g = torch.Generator().manual_seed(seed)
    for cache in pool.kv_caches:
        cache.copy_(torch.randint(0, 255, cache.shape, generator=g).to(cache.dtype) if dtype == "fp8"
                    else torch.randn(cache.shape, generator=g).to(cache.dtype))
    want = [c.view(-1, 576)[torch.cat([torch.arange(p * page, (p + 1) * page) for p in a])][:ntok].clone()
            for c in pool.kv_caches]
    bk = pool.backup(a, ntok)
    assert bk.num_tokens == ntok and bk.layers[0].device.type == "cpu"
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    # scribble over the freed pages so a restore that reads stale device memory fails
    for c in pool.kv_caches:
        c.zero_()
    b = pool.restore(bk, extra_pages=1)
    assert len(b) == -(-ntok // page) + 1
    got = [c.view(-1, 576)[torch.cat([torch.arange(p * page, (p + 1) * page) for p in b])][:ntok] for c in pool.kv_caches]
    for w, g2 in zip(want, got):
        assert torch.equal(w, g2)
    with pytest.raises(OutOfPages):
        pool.allocate(pool.num_free_pages + 1)
    pool.free(b)
    assert pool.num_free_pages == cap and pool.usage == 0.0


@pytest.mark.parametrize("kind", sorted(ALLOCATORS))
def test_bad_frees_are_named(kind):
    alloc = create_allocator(6, 1, kind)
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([0])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([6])
    with pytest.raises(ValueError, match=">= 0"):
        alloc.allocate(-1)
    assert alloc.allocate(0) == []


def test_backup_rejects_foreign_pages():
    pool = MLAKVPool(1, 8, 16, "bf16")
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="not all allocated"):
        pool.backup([a[0], 7], 20)


def test_restore_into_a_mismatched_pool_is_rejected():
    src = MLAKVPool(1, 8, 16, "bf16")
    dst = MLAKVPool(1, 8, 64, "bf16")
    bk = src.backup(src.allocate(1), 10)
    with pytest.raises(ValueError, match="matching pool"):
        dst.restore(bk)


def test_failed_restore_leaks_no_pages():
    src = MLAKVPool(1, 8, 16, "bf16")
    dst = MLAKVPool(1, 8, 64, "bf16")
    bk = src.backup(src.allocate(1), 10)
    free = dst.num_free_pages
    with pytest.raises(ValueError):
        dst.restore(bk)
    assert dst.num_free_pages == free
