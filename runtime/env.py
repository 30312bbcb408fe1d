"""Environment switches of the runtime, read when asked (never at import), in one place.

PDLAB_CHECK_INVARIANTS=1  the scheduler checks page ownership after every step (tests, debugging).
PDLAB_STEP_PROFILE=1      the engine records host-side time per decode step (scheduler/Python share).
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


ENV = _Env()
