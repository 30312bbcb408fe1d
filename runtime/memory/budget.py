"""How much memory a device has left, and the check that refuses an allocation that cannot fit before it is
tried: an absurd setting (a model of thousands of layers, a KV pool of billions of tokens) fails at once with the
estimate, instead of an out-of-memory traceback minutes later or a machine swapping into a hang."""

from __future__ import annotations

from pathlib import Path

import torch

GiB = float(1 << 30)


class MemoryBudgetError(ValueError):
    """An allocation that cannot fit the device; the message names what, the bytes estimated, the bytes available
    and the setting to change."""


def available_bytes(device: str | torch.device) -> int | None:
    """Bytes that can still be allocated on `device`: free memory of a CUDA device; on the CPU the kernel's
    MemAvailable, lowered to the cgroup's limit minus its usage where a container limit is set. None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    avail = _meminfo_available()
    limit = _cgroup_headroom()
    if avail is None:
        return limit
    return avail if limit is None else min(avail, limit)


def check_fits(what: str, need: int, device: str | torch.device, fix: str, available: int | None = None) -> None:
    """Raise MemoryBudgetError when `need` bytes exceed what `device` has left (`available`, else measured now).
    what: the allocation, for the message ("the model weights (61 layers ...)"); fix: how to shrink it."""
    have = available_bytes(device) if available is None else available
    if have is None or need <= have:
        return
    raise MemoryBudgetError(f"{what} need about {fmt_bytes(need)}, but {torch.device(device)} has "
                            f"{fmt_bytes(have)} available; {fix}")


def fmt_bytes(n: float) -> str:
    """A byte count for messages: GiB with two significant decimals, TiB above 1024 GiB, MiB below 1 GiB."""
    if n >= 1024 * GiB:
        return f"{n / (1024 * GiB):.2f} TiB"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_headroom() -> int | None:
    """The memory limit of this process's cgroup minus its usage (v2 memory.max / memory.current, v1
    memory.limit_in_bytes / memory.usage_in_bytes); None without a limit."""
    try:
        rel = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
        v2 = Path("/sys/fs/cgroup") / rel.lstrip("/")
        v1 = Path("/sys/fs/cgroup/memory")
        pairs = [(v2 / "memory.max", v2 / "memory.current"),
                 (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes")]
        for limit_file, usage_file in pairs:
            if limit_file.is_file():
                limit = limit_file.read_text().strip()
                if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for "no limit"
                    return None
                return max(0, int(limit) - int(usage_file.read_text()))
    except (OSError, ValueError):
        pass
    return None
