"""Roofline arithmetic: FLOPs and bytes of one call plus its time → TFLOPS, GB/s, % of peak."""

from __future__ import annotations

import torch

from pdlab.kernels.arch import DeviceFacts

# What each compute dtype's roofline is measured against (the CSVs' `compute_peak` column). fp32 work runs on the CUDA
# cores, not on TF32 tensor cores: the Triton kernels take fp32 inputs with input_precision="ieee" and the torch
# references turn TF32 off, so its peak is the plain fp32 FMA rate (67 TFLOPS on H100/H200, not bf16's 989).
PEAK_LABELS = {"bf16": "bf16 tensor cores", "fp16": "fp16 tensor cores", "fp8": "fp8 tensor cores",
               "fp4": "fp4 tensor cores", "fp32": "fp32 CUDA cores (no TF32)"}
_OF_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compute_dtype(dtype: torch.dtype) -> str:
    """The roofline compute dtype of work whose matmul inputs are `dtype` (bf16, fp16 or fp32; others: bf16)."""
    return _OF_DTYPE.get(dtype, "bf16")


def peak_flops(peaks, compute_dtype: str) -> float:
    """The device's FLOP/s peak for work of `compute_dtype` (a `PEAK_LABELS` key); 0 where it is not known."""
    return {"bf16": peaks.bf16_flops, "fp16": peaks.bf16_flops, "fp8": peaks.fp8_flops,
            "fp4": peaks.fp4_flops or peaks.bf16_flops, "fp32": peaks.fp32_flops}[compute_dtype]


def peak_lines(peaks, labels) -> list[tuple[float, str]]:
    """(TFLOPS, "<label> peak") for each distinct `compute_peak` label in `labels` (a CSV column: None/NaN skipped),
    in the order first seen: the horizontal lines of a TFLOPS plot whose rows ran on different units (an fp32 row
    under the CUDA-core peak, not the tensor cores')."""
    if peaks is None:
        return []
    of_label = {v: k for k, v in PEAK_LABELS.items()}
    lines = []
    for label in dict.fromkeys(x for x in labels if isinstance(x, str) and x in of_label):
        value = peak_flops(peaks, of_label[label])
        if value:
            lines.append((value / 1e12, f"{label} peak"))
    return lines


def roofline(flops: float, nbytes: float, seconds: float, facts: DeviceFacts | None,
             compute_dtype: str = "bf16") -> dict:
    """Achieved rates and the share of the device's roofline for one timed call.

    compute_dtype: a key of `PEAK_LABELS`, the units the FLOPs run on. Returns {"tflops", "gbps", "intensity",
    "bound" ("memory"|"compute"|"?"), "floor_us", "pct_roofline", "compute_peak"}: pct_roofline = floor time /
    measured time, where the floor is max(flops / peak_flops, bytes / peak_bandwidth), and compute_peak the
    `PEAK_LABELS` entry of the peak taken; "?", nan and None where the device's peak of that dtype is unknown."""
    out = {"tflops": flops / seconds / 1e12 if seconds > 0 else float("nan"),
           "gbps": nbytes / seconds / 1e9 if seconds > 0 else float("nan"),
           "intensity": flops / nbytes if nbytes else float("inf"),
           "bound": "?", "floor_us": float("nan"), "pct_roofline": float("nan"), "compute_peak": None}
    peaks = facts.peaks if facts is not None else None
    if peaks is None or seconds <= 0:
        return out
    peak = peak_flops(peaks, compute_dtype)
    if flops and not peak:  # no compute floor to compare with: the memory one alone would misname the bound
        return out
    t_compute = flops / peak if peak else 0.0
    t_memory = nbytes / peaks.hbm_bytes_per_s
    floor = max(t_compute, t_memory)
    out.update(bound="compute" if t_compute > t_memory else "memory", floor_us=floor * 1e6,
               pct_roofline=100.0 * floor / seconds, compute_peak=PEAK_LABELS[compute_dtype])
    return out
