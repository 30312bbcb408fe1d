"""Prefill manager: picks the requests of the next prefill step, FCFS, under a token budget.

Order: requests already part-way through a chunked prefill first, then the waiting queue in arrival
order (retracted requests keep their arrival position, so they come back before newer ones). A
request is admitted only if its pages fit in the free pages minus the headroom reserved for running
decodes; the first one that does not fit stops admission (no overtaking, so no starvation).
A retracted request with a CPU backup is restored first; if only its last token is missing it goes
straight back to decoding. With a prefix cache, a request is admitted with the cached pages of its longest cached
prefix (whole pages) and computes only the rest; and a request whose next page (the same tokens from the start) is
computed by another request in this very step waits for the next step, when it reads that page from the cache
instead of computing it again (a burst of requests behind one system prompt computes it once). That is the one case
of a later request being admitted before it: the deferred one comes first again in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdlab.runtime.core import Req, ReqStatus
from pdlab.runtime.memory.pool import MLAKVPool
from pdlab.runtime.scheduler.retract import resume


@dataclass
class PrefillPlan:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    admitted: list[Req] = field(default_factory=list)  # left the waiting queue this step
    to_decode: list[Req] = field(default_factory=list)  # restored requests that only need decoding


class PrefillManager:
    def __init__(self, pool: MLAKVPool, chunked_prefill_size: int, max_prefill_tokens: int,
                 max_running_requests: int, reserve_tokens: int):
        self.pool = pool
        self.chunk = chunked_prefill_size
        self.budget = max_prefill_tokens
        self.max_running = max_running_requests
        self.reserve_tokens = reserve_tokens
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed, hold pages

    def plan(self, waiting: list[Req], num_running: int, reserve_pages: int, next_admit: int) -> PrefillPlan:
        ps = self.pool.page_size
        plan = PrefillPlan()
        budget = self.budget
        free = self.pool.num_free_pages
        cache = self.pool.prefix_cache
        # with a cache: the pages this step computes right after a request's shared ones (`PrefixCache.next_page`)
        computing: set = set()
        for r in self.prefilling:
            n = min(r.extend_len, self.chunk, budget)
            need = -(-(r.cached_len + n) // ps) - len(r.pages)
            if n <= 0 or need > free:
                break
            if cache is not None:
                computing.add(cache.next_page(r, r.cached_len + n))  # (None: no page to name)
            r.pages += self.pool.allocate(need)
            free -= need
            budget -= n
            plan.reqs.append(r)
            plan.extend_lens.append(n)
        slots = self.max_running - num_running - len(self.prefilling)
        per_req_reserve = -(-self.reserve_tokens // ps)
        for r in waiting:
            if slots <= 0 or budget <= 0:
                break
            matched = cache is not None and r.backup is None and not r.pages and cache.match(r) > 0
            # (its next page is shareable if it ends before its last token, which it always computes)
            nxt = cache.next_page(r, r.seq_len - 1) if cache is not None and r.backup is None else None
            if nxt is not None and nxt in computing:
                if matched:  # computed in this step by another request: read from the cache in the next
                    cache.unmatch(r)
                continue
            if matched:
                free = self.pool.num_free_pages  # the matched pages are no longer evictable
            n = 1 if r.extend_len == 1 and r.backup is not None else min(r.extend_len, self.chunk, budget)
            need = -(-(r.cached_len + n) // ps) - len(r.pages)
            if need > free - reserve_pages:
                if matched:  # not admitted: give the pages back, match again next time
                    cache.unmatch(r)
                break
            r.admitted_at = next_admit + len(plan.admitted)
            plan.admitted.append(r)
            if cache is not None and r.cached_tokens is None:  # its first admission: what usage reports
                r.cached_tokens = min(r.cached_len, r.prompt_len) if r.backup is None else 0
            if r.backup is not None:
                resume(r, self.pool, n)
            else:
                r.pages += self.pool.allocate(need)
            free -= need
            reserve_pages += per_req_reserve
            slots -= 1
            if r.extend_len == 1 and r.output_ids:  # restored mid-decode: nothing to prefill
                r.status = ReqStatus.RUNNING
                plan.to_decode.append(r)
                continue
            r.status = ReqStatus.PREFILLING
            self.prefilling.append(r)
            plan.reqs.append(r)
            plan.extend_lens.append(n)
            budget -= n
            if cache is not None:
                computing.add(cache.next_page(r, r.cached_len + n))  # (None: no page to name)
        return plan

