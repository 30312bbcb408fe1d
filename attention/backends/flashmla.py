"""`flashmla` backend: adapter for DeepSeek's `flash_mla` package (sm90 dense decode, bf16/fp16
cache, page 64). Two metadata generations exist: 2025 releases return (tile_scheduler_metadata,
num_splits) tensors from `get_mla_metadata(cache_seqlens, s_q*h_q//h_kv, h_kv)`; newer releases
return (FlashMLASchedMeta, None) and fill the object during the first call. Detected per call."""

from __future__ import annotations

import torch

from pdlab.kernels.registry import register_backend


def _flash_mla():
    import flash_mla

    return flash_mla


def metadata(flash_mla, seqlens: torch.Tensor, q_len: int, num_heads: int) -> tuple:
    """(tile_scheduler_metadata, num_splits) in whichever form this flash_mla returns, for seqlens [B] int32 (CUDA)."""
    meta, splits = flash_mla.get_mla_metadata(seqlens, q_len * num_heads, 1)
    if isinstance(meta, torch.Tensor):  # 2025 API: device tensors, to pass as they are
        return meta, splits
    return meta, None  # scheduler object (newer API): num_splits must be None


@register_backend("mla_decode", "flashmla", archs=("sm90",), packages=("flash_mla",), priority=100,
                  options={"page_sizes": (64,), "kv_dtypes": ("bf16", "fp16"), "q_dtypes": ("bf16", "fp16"),
                           "q_lens": (1, 2, 4)})
def mla_decode_flashmla(q, kv_cache, block_table, seqlens, softmax_scale, *, kv_scale=None, config=None):
    """FlashMLA dense decode: cache viewed as [P, 64, 1, 576]; causal among the S_q new tokens."""
    fm = _flash_mla()
    B, Sq, H, _ = q.shape
    k_cache = kv_cache.unsqueeze(2)
    meta, splits = metadata(fm, seqlens, Sq, H)
    out, lse = fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits,
                                         softmax_scale=softmax_scale, causal=Sq > 1)
    return out, lse
