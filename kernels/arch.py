"""Device facts: architecture detection, peak numbers for the roofline, measured bandwidth.

Archs are named `cpu`, `sm80`, `sm89`, `sm90`, `sm100`, `sm103`, `sm120`, ... (compute capability
major*10 + minor). Peak numbers are vendor datasheet figures (dense, no sparsity) with their source;
`measured_peaks()` replaces them with figures measured once on this machine and cached.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Peaks:
    """Peak rates of one device. Bandwidth in bytes/s, compute in FLOP/s (dense)."""

    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float  # 0 where the device has no FP4 tensor cores
    source: str
    # fp32 FMA on the CUDA cores (no tensor cores, no TF32): what fp32 kernels and references run at; 0 = unknown
    fp32_flops: float = 0.0

    def ridge(self, dtype: str = "bf16") -> float:
        """FLOP per byte above which a kernel is compute-bound."""
        return {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops,
                "fp32": self.fp32_flops}[dtype] / self.hbm_bytes_per_s


# Datasheet figures, dense (sparsity halves them away). Sources: NVIDIA H100/H200 datasheets (SXM),
# DGX B200 / GB200 NVL72 datasheets (per GPU); fp32 (CUDA cores): the same sheets, HGX B200/B300 for B200/B300.
_PEAKS: dict[str, Peaks] = {
    "H100": Peaks(3.35e12, 989e12, 1979e12, 0.0, "NVIDIA H100 SXM datasheet", 67e12),
    "H200": Peaks(4.8e12, 989e12, 1979e12, 0.0, "NVIDIA H200 SXM datasheet", 67e12),
    "H800": Peaks(3.35e12, 989e12, 1979e12, 0.0, "NVIDIA H800 SXM (H100 rates)", 67e12),
    "H20": Peaks(4.0e12, 148e12, 296e12, 0.0, "NVIDIA H20 datasheet", 44e12),
    "B200": Peaks(8.0e12, 2250e12, 4500e12, 9000e12, "NVIDIA DGX B200 datasheet (per GPU)", 75e12),
    "GB200": Peaks(8.0e12, 2500e12, 5000e12, 10000e12, "NVIDIA GB200 NVL72 datasheet (per GPU)", 80e12),
    "B300": Peaks(8.0e12, 2250e12, 4500e12, 13500e12, "NVIDIA Blackwell Ultra datasheet (per GPU)", 75e12),
}


@dataclass(frozen=True)
class DeviceFacts:
    """What pdlab knows about one device."""

    name: str  # e.g. "NVIDIA H200" or "cpu"
    arch: str  # "cpu", "sm90", "sm100", ...
    sm_count: int
    memory_bytes: int
    peaks: Peaks | None  # None: unknown device (no roofline)

    @property
    def key(self) -> str:
        """File-name-safe device key used by the tuned-config store: `NVIDIA_H200`."""
        return self.name.replace(" ", "_").replace("/", "_")


def detect_arch(device: torch.device | str | int | None = None) -> str:
    """`cpu` without CUDA (or for a CPU device), else `sm<major><minor>` of the given CUDA device.
    Cheap after the first call per device (called on every op dispatch)."""
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return "cpu"
        index = dev.index
    elif not torch.cuda.is_available():
        return "cpu"
    else:
        index = None
    if index is None:
        index = torch.cuda.current_device()
    arch = _ARCHS.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _ARCHS[index] = f"sm{major}{minor}"
    return arch


_ARCHS: dict[int, str] = {}  # CUDA device index -> arch


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds (Hopper and Blackwell datacenter parts): registers, shared memory (per SM, and the most one
    program may ask for; each resident program takes `reserved_shared` more), warps, programs."""

    registers: int = 65536
    shared: int = 228 * 1024
    shared_per_program: int = 227 * 1024
    reserved_shared: int = 1024
    warps: int = 64
    programs: int = 32

    def programs_per_sm(self, *, registers: int | None, shared: int, warps: int) -> dict[str, int | None]:
        """How many programs of `warps` warps using `registers` per thread (None: unknown) and `shared` bytes fit on
        one SM: {"programs_per_sm", "by_registers", "by_shared"}."""
        by_regs = self.registers // max(1, registers * 32 * warps) if registers else None
        by_smem = self.shared // max(1, shared + self.reserved_shared)
        fits = min(x for x in (by_regs, by_smem, self.warps // warps, self.programs) if x is not None)
        return {"programs_per_sm": fits, "by_registers": by_regs, "by_shared": by_smem}


SM90 = SmLimits()


def wgmma_unavailable(device: torch.device) -> str | None:
    """None when `device` is a CUDA GPU of sm90 (the wgmma instructions pdlab's Gluon kernels are written for), else
    why not. The capability is read once per device."""
    if device.type != "cuda":
        return "needs a CUDA GPU"
    return _wgmma_unavailable(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _wgmma_unavailable(index: int) -> str | None:
    if torch.cuda.get_device_capability(index)[0] != 9:
        return "wgmma kernels are sm90 (Hopper) only"
    return None


def arch_family(arch: str) -> str:
    """`sm90a`-style suffixes dropped; sm100/sm103 are one family for kernels built for `sm100`."""
    arch = arch.rstrip("af")
    return "sm100" if arch in ("sm100", "sm103", "sm110") else arch


def _peaks_for_name(name: str) -> Peaks | None:
    upper = name.upper()
    for key in sorted(_PEAKS, key=len, reverse=True):  # GB200 before B200, H200 before H20
        if key in upper.replace("NVIDIA", "").split() or f" {key}" in f" {upper}":
            return _PEAKS[key]
    return None


def device_facts(device: torch.device | str | int | None = None) -> DeviceFacts:
    """Facts of the given (or current) device; the CPU when CUDA is absent."""
    arch = detect_arch(device)
    if arch == "cpu":
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return DeviceFacts("cpu", "cpu", os.cpu_count() or 1, mem, None)
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    peaks = measured_peaks(props.name) or _peaks_for_name(props.name)
    return DeviceFacts(props.name, arch, props.multi_processor_count, props.total_memory, peaks)


def peaks_table() -> dict[str, Peaks]:
    """The datasheet table (name → Peaks), for reports."""
    return dict(_PEAKS)


# ---------------------------------------------------------------------------------------------
# measured ceilings, cached per device name


def _cache_path() -> Path:
    root = os.environ.get("PDLAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdlab")
    return Path(root) / "measured_peaks.json"


def measured_peaks(name: str) -> Peaks | None:
    """Peaks measured earlier on a device of this name (see `measure_peaks`), or None."""
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(name)
    if not entry:
        return None
    peaks = Peaks(**entry)
    if not peaks.fp32_flops:  # cached before fp32 was recorded: the datasheet's ratio to bf16, as measure_peaks does
        sheet = _peaks_for_name(name)
        if sheet:
            peaks = replace(peaks, fp32_flops=peaks.bf16_flops * sheet.fp32_flops / sheet.bf16_flops)
    return peaks


def measure_peaks(device: int | None = None, save: bool = True) -> Peaks:
    """Measure HBM copy bandwidth (bytes read + written) and the bf16 matmul rate on this GPU, cache
    them, and return Peaks where fp8/fp4/fp32 keep the datasheet ratio to bf16."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_peaks needs a CUDA device")
    dev = torch.device("cuda", device if device is not None else torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # 1 GiB, far beyond L2
    dst = torch.empty_like(src)
    bw = _best_rate(lambda: dst.copy_(src), 2 * src.numel())
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    flops = _best_rate(lambda: a @ b, 2 * n**3)
    sheet = _peaks_for_name(name)
    ratio8 = sheet.fp8_flops / sheet.bf16_flops if sheet else 2.0
    ratio4 = sheet.fp4_flops / sheet.bf16_flops if sheet else 0.0
    ratio32 = sheet.fp32_flops / sheet.bf16_flops if sheet else 0.0
    peaks = Peaks(bw, flops, flops * ratio8, flops * ratio4,
                  f"measured on this machine {time.strftime('%Y-%m-%d')} (copy, bf16 8192^3 matmul)", flops * ratio32)
    if save:
        path = _cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[name] = asdict(peaks)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    return peaks


def _best_rate(fn, units: float, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return units / times[len(times) // 2]


def with_peaks(facts: DeviceFacts, peaks: Peaks) -> DeviceFacts:
    return replace(facts, peaks=peaks)
