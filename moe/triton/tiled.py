"""Addresses in the tiled NVFP4 layout (`pdlab.moe.weights.tile_nvfp4`) for the Triton kernels that read it.

A row group of 16 rows is stored chunk by chunk along K: chunk c (128 elements) holds 16 rows × 64 weight bytes
(1024 bytes) and 16 rows × 8 scale bytes (128 bytes). KH = K/2 weight bytes per row.
"""

import triton
import triton.language as tl


@triton.jit
def tiled_rows(n, KH):
    """Offsets of the starts of rows n (int64): (weight bytes, scale bytes)."""
    return (n // 16) * (16 * KH) + (n % 16) * 64, (n // 16) * (2 * KH) + (n % 16) * 8


@triton.jit
def tiled_chunk(c):
    """Offsets, from its row's start, of K chunk c (128 elements): (weight bytes, scale bytes)."""
    return c * 1024, c * 128


@triton.jit
def tiled_cols(jb, js):
    """Offsets, from its row's start, of weight byte jb and scale byte js of that row."""
    return (jb // 64) * 1024 + jb % 64, (js // 8) * 128 + js % 8
