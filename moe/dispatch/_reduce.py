"""gather_reduce: out[m] = Σ_j w[m, j] · src[index[m, j]] (index -1 = skip), fp32 accumulation.

The arithmetic of every combine: on the receiving rank (experts' rows → one row per received token,
weighted) and on the sending rank (one row per (token, rank) → the token, unweighted). A Triton
kernel on CUDA (reads only the rows it sums, writes the output once) and a torch fallback.
"""

from __future__ import annotations

import torch


def gather_reduce(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype,
                  *, impl: str = "auto", chunk_rows: int = 4096) -> torch.Tensor:
    """Weighted gather-sum of rows.

    Args:
        src: [N, H] bf16|fp16|fp32, last dim contiguous. index: [M, J] int64, row of src or -1 (skip).
        weights: [M, J] fp32 or None (all ones). out_dtype: dtype of the result.
        impl: "triton" | "torch" | "auto" (triton on CUDA when triton imports).
    Returns: [M, H] of out_dtype (fp32 accumulation)."""
    M, J = index.shape
    H = src.shape[1]
    if impl == "auto":
        impl = "triton" if src.is_cuda and _triton_ok() else "torch"
    if impl == "triton" and M and J:
        out = torch.empty((M, H), dtype=out_dtype, device=src.device)
        src = src if src.stride(-1) == 1 else src.contiguous()
        idx = index.contiguous()
        w = weights.float().contiguous() if weights is not None else idx  # placeholder pointer when unweighted
        BLOCK_H = 1024 if H >= 1024 else max(16, 1 << (H - 1).bit_length())
        grid = (M, triton_cdiv(H, BLOCK_H))
        _kernel()[grid](src, idx, w, out, H, J, src.stride(0), out.stride(0), HAS_W=weights is not None,
                        BLOCK_H=BLOCK_H, num_warps=4)
        return out
    out = torch.zeros((M, H), dtype=torch.float32, device=src.device)
    for r0 in range(0, M, chunk_rows):
        r1 = min(M, r0 + chunk_rows)
        idx = index[r0:r1]
        acc = out[r0:r1]
        for j in range(J):
            col = idx[:, j]
            rows = src.index_select(0, col.clamp_min(0)).float()
            scale = (col >= 0).float() if weights is None else torch.where(col >= 0, weights[r0:r1, j].float(), 0.0)
            acc.addcmul_(rows, scale[:, None])
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_OK: list[bool] = []
_KERNEL: list = []


def _triton_ok() -> bool:
    if not _OK:
        try:
            import triton  # noqa: F401

            _OK.append(True)
        except ImportError:
            _OK.append(False)
    return _OK[0]


def _kernel():
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def gather_reduce_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, H, J, stride_src, stride_out,
                             HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(J):
            row = tl.load(idx_ptr + m * J + j)
            if row >= 0:
                v = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + m * J + j)
                acc += v
        tl.store(out_ptr + m * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    _KERNEL.append(gather_reduce_kernel)
    return gather_reduce_kernel
