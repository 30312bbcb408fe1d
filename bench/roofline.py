"""Roofline arithmetic: FLOPs and bytes of one call plus its time → TFLOPS, GB/s, % of peak."""

from __future__ import annotations

from pdlab.kernels.arch import DeviceFacts


def roofline(flops: float, nbytes: float, seconds: float, facts: DeviceFacts | None,
             compute_dtype: str = "bf16") -> dict:
    """Achieved rates and the share of the device's roofline for one timed call.

    Returns {"tflops", "gbps", "intensity", "bound" ("memory"|"compute"|"?"), "floor_us",
    "pct_roofline"}: pct_roofline = floor time / measured time, where the floor is
    max(flops / peak_flops, bytes / peak_bandwidth)."""
    out = {"tflops": flops / seconds / 1e12 if seconds > 0 else float("nan"),
           "gbps": nbytes / seconds / 1e9 if seconds > 0 else float("nan"),
           "intensity": flops / nbytes if nbytes else float("inf"),
           "bound": "?", "floor_us": float("nan"), "pct_roofline": float("nan")}
    peaks = facts.peaks if facts is not None else None
    if peaks is None or seconds <= 0:
        return out
    peak_flops = {"bf16": peaks.bf16_flops, "fp16": peaks.bf16_flops, "fp8": peaks.fp8_flops,
                  "fp4": peaks.fp4_flops or peaks.bf16_flops}[compute_dtype]
    t_compute = flops / peak_flops if peak_flops else 0.0
    t_memory = nbytes / peaks.hbm_bytes_per_s
    floor = max(t_compute, t_memory)
    out.update(bound="compute" if t_compute > t_memory else "memory", floor_us=floor * 1e6,
               pct_roofline=100.0 * floor / seconds)
    return out
