"""Environment switches, read when asked (never at import), in one place (here, so that the ops may read them too).

PDLAB_CHECK_INVARIANTS=1  the scheduler checks page ownership after every step; `run_experts` checks its layout's
                          row counts against the slab and the row bound, dispatch its GPU expert ids, mla_prefill its
                          GPU qo_indptr and seqlens (against T, max_q_len and each other), as they do for CPU tensors
                          (one host sync per call, none while a CUDA graph is captured) (tests, debugging).
PDLAB_STEP_PROFILE=1      the engine records host-side time per decode step (scheduler/Python share).
PDLAB_STEP_LOG=FILE       the scheduler appends one JSON line per step to FILE: wall time, role, pid, prefill or decode,
                          requests, tokens, schedule / forward / process ms, queue, whether it was a warm-up step,
                          the CUDA allocator's reserved MiB (to find which steps make a latency tail).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _Env:
    @property
    def check_invariants(self) -> bool:
        return _flag("PDLAB_CHECK_INVARIANTS")

    @property
    def step_profile(self) -> bool:
        return _flag("PDLAB_STEP_PROFILE")

    @property
    def step_log(self) -> str | None:
        return os.environ.get("PDLAB_STEP_LOG") or None


ENV = _Env()
