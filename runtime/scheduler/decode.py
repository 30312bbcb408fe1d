"""Decode manager: the running set, and how many pages it needs for its next step and as headroom."""

from __future__ import annotations

from pdlab.runtime.core import Req


class DecodeManager:
    def __init__(self, page_size: int, reserve_tokens: int):
        self.page_size = page_size
        self.reserve_tokens = reserve_tokens
        self.running: list[Req] = []

    def pages_for_step(self, req: Req) -> int:
        """Pages `req` must gain before its next decode step (0 or 1)."""
        return max(0, -(-(req.cached_len + 1) // self.page_size) - len(req.pages))

    def reserve_pages(self) -> int:
        """Headroom kept free for the running set when admitting new requests: the pages each running
        request needs to decode min(reserve_tokens, tokens it may still produce) more tokens."""
        total = 0
        for r in self.running:
            more = min(self.reserve_tokens, max(1, r.params.max_tokens - len(r.output_ids)))
            total += max(0, -(-(r.cached_len + more) // self.page_size) - len(r.pages))
        return total

    def add(self, req: Req) -> None:
        self.running.append(req)

    def remove(self, req: Req) -> None:
        self.running.remove(req)
