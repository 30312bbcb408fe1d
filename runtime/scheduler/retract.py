"""Retraction under KV memory pressure, and resumption when pages come back.

Victim policy: the most recently admitted request that holds pages goes first (LIFO by admission).
The oldest admitted request is therefore never retracted while another one holds pages, and since the
pool holds at least one maximal request (checked at start-up), it always makes progress: no livelock.
A LIFO victim has also spent the least time on the GPU, so the least work is parked.

Retracting a request: back its KV up to CPU (`retract_mode="backup"`, pinned chunked copies) or drop
it (`"recompute"`, cached_len = 0), free its pages (with a prefix cache, its full pages are cached: a recomputed
request that comes back before they are evicted matches them), and put it back in the waiting queue at its arrival
position. Resuming: restore the backup into fresh pages (or recompute through prefill); its tokens and
sampling state are untouched, so greedy outputs are identical to a run without pressure.
"""

from __future__ import annotations

from pdlab.runtime.core import Req, ReqStatus
from pdlab.runtime.memory.pool import MLAKVPool
from pdlab.runtime.memory.table import PageTable


def pick_victim(holders: list[Req]) -> Req | None:
    """The request to retract among `holders` (requests holding pages): the last admitted one.
    None when at most one request holds pages (it fits alone by construction, so it must run)."""
    cands = [r for r in holders if r.pages]
    if len(cands) <= 1:
        return None
    return max(cands, key=lambda r: r.admitted_at)


def retract(req: Req, pool: MLAKVPool, table: PageTable, mode: str) -> None:
    """Free `req`'s pages after backing its KV up (mode "backup") or dropping it (mode "recompute")."""
    if mode == "backup" and req.cached_len > 0:
        req.backup = pool.backup(req.pages, req.cached_len)
    else:
        req.backup = None
    pool.release_pages(req, keep=True)
    if req.backup is None:
        req.cached_len = 0
    table.release(req)
    req.status = ReqStatus.RETRACTED
    req.num_retractions += 1


def resume(req: Req, pool: MLAKVPool, extra_tokens: int) -> None:
    """Give a retracted request with a backup its pages back: room for cached_len + extra_tokens tokens."""
    assert req.backup is not None and not req.pages
    ps = pool.page_size
    need = -(-(req.cached_len + extra_tokens) // ps)
    have = -(-req.backup.num_tokens // ps)
    req.pages = pool.restore(req.backup, extra_pages=max(0, need - have))
    req.backup = None


def pages_to_resume(req: Req, page_size: int, extra_tokens: int) -> int:
    return -(-(req.cached_len + extra_tokens) // page_size)
