"""`trtllm_mla` backend: adapter for flashinfer's `trtllm_batch_decode_with_kv_cache_mla` (trtllm-gen
cubins, sm100/sm103). Cache viewed as [P, 1, page, 576]; page 32 or 64; the block table is padded
(with page 0, never read past seq_lens) to a multiple of 128/page columns; a zeroed 128 MiB
workspace is kept per device (the kernel's semaphores must start at zero). Scales:
bmm1_scale = q_scale * k_scale * softmax_scale, bmm2_scale = v_scale * o_scale, with k_scale =
v_scale = kv_scale for fp8 pools (q cast to e4m3 with q_scale = 1, the kernel's fp8 mode) and 1 otherwise.
The function lives in flashinfer.mla (>= 0.6) or flashinfer.decode (<= 0.5); lse comes back only
where the installed version has `return_lse` (else lse is NaN)."""

from __future__ import annotations

import inspect
import math

import torch

from pdlab.kernels.registry import register_backend

WORKSPACE_BYTES = 128 << 20
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def workspace(device: torch.device) -> torch.Tensor:
    """The zero-initialised 128 MiB workspace of `device` (allocated once): [WORKSPACE_BYTES] uint8."""
    buf = _WORKSPACES.get(device)
    if buf is None:
        buf = _WORKSPACES[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return buf


def _vendor_fn():
    try:
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla as fn
    except ImportError:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla as fn
    return fn


def _probe() -> str | None:
    try:
        _vendor_fn()
    except ImportError as exc:
        return f"flashinfer has no trtllm_batch_decode_with_kv_cache_mla ({exc})"
    return None


@register_backend("mla_decode", "trtllm_mla", archs=("sm100",), packages=("flashinfer",), probe=_probe,
                  priority=100, options={"page_sizes": (32, 64), "kv_dtypes": ("bf16", "fp8"),
                                         "q_dtypes": ("bf16",), "q_lens": (1, 2, 4)})
def mla_decode_trtllm(q, kv_cache, block_table, seqlens, softmax_scale, *, kv_scale=None, config=None):
    """trtllm-gen MLA decode (sm100)."""
    fn = _vendor_fn()
    B, Sq, H, _ = q.shape
    P, page, _ = kv_cache.shape
    fp8 = kv_cache.dtype == torch.uint8
    kv = kv_cache.view(torch.float8_e4m3fn) if fp8 else kv_cache
    query = q.clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else q
    k_scale = kv_scale if fp8 else 1.0
    q_scale = 1.0
    if isinstance(k_scale, torch.Tensor):  # stays on the device: no sync, graph-safe
        bmm1 = (k_scale.float().reshape(1) * (q_scale * softmax_scale))
        bmm2 = k_scale.float().reshape(1)
    else:
        bmm1, bmm2 = q_scale * float(k_scale) * softmax_scale, float(k_scale)
    cols = block_table.shape[1]
    multiple = max(1, 128 // page)
    padded = math.ceil(cols / multiple) * multiple
    table = torch.nn.functional.pad(block_table, (0, padded - cols)) if padded != cols else block_table
    out = torch.empty(B, Sq, H, 512, dtype=torch.bfloat16, device=q.device)
    kwargs = dict(query=query, kv_cache=kv.unsqueeze(1), workspace_buffer=workspace(q.device),
                  qk_nope_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, block_tables=table,
                  seq_lens=seqlens, max_seq_len=cols * page, out=out, bmm1_scale=bmm1, bmm2_scale=bmm2)
    want_lse = "return_lse" in inspect.signature(fn).parameters
    if want_lse:
        kwargs["return_lse"] = True
    res = fn(**kwargs)
    lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    if want_lse and isinstance(res, tuple):
        res, vendor_lse = res
        if vendor_lse.numel() == B * Sq * H:
            lse = vendor_lse.float().reshape(B, Sq, H).transpose(1, 2).contiguous()
    out = res if isinstance(res, torch.Tensor) else out
    return out.to(q.dtype), lse
