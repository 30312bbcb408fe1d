"""Device page table: one row of page ids per running request, [max_rows + 1, max_pages] int32.

The last row is all zeros (the reserved dummy page) and is what padded CUDA-graph rows read. Rows
are written incrementally: only pages a request gained since the last step cross to the device.
"""

from __future__ import annotations

import torch

from pdlab.runtime.core import Req


class PageTable:
    def __init__(self, max_rows: int, max_pages: int, device: torch.device):
        self.max_rows = max_rows
        self.max_pages = max_pages
        self.device = device
        self.table = torch.zeros(max_rows + 1, max_pages, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def dummy_row(self) -> int:
        return self.max_rows

    def sync(self, reqs: list[Req]) -> None:
        """Give each request a row if it has none and write the pages it gained since the last sync."""
        rows, cols, vals = [], [], []
        for r in reqs:
            if r.table_row < 0:
                if not self._free_rows:
                    raise RuntimeError(f"page table full ({self.max_rows} rows): more running requests than "
                                       "max_running_requests; the scheduler must not admit more")
                r.table_row = self._free_rows.pop()
                r.table_len = 0
            n = len(r.pages)
            if n > self.max_pages:
                raise ValueError(f"request {r.rid} holds {n} pages, the table has {self.max_pages} columns "
                                 "(max_context_len / page_size); it should have been rejected at admission")
            if n > r.table_len:
                rows.extend([r.table_row] * (n - r.table_len))
                cols.extend(range(r.table_len, n))
                vals.extend(r.pages[r.table_len:])
                r.table_len = n
        if rows:
            idx = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            self.table[idx[0], idx[1]] = torch.tensor(vals, dtype=torch.int32).to(self.device, non_blocking=True)

    def release(self, req: Req) -> None:
        """Forget a request's row (its pages were freed or replaced); the row is reused later."""
        if req.table_row >= 0:
            self._free_rows.append(req.table_row)
        req.table_row = -1
        req.table_len = 0
