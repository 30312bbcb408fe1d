"""MLA attention ops (decode, prefill/extend, KV store) over a paged latent cache, with backends
torch (reference), triton (pdlab's kernels), flashmla, trtllm_mla and flashinfer."""

from pdlab.attention import backends  # noqa: F401  (registers the backends)
from pdlab.attention.kv import dequantize_kv_fp8, quantize_kv_fp8
from pdlab.attention.ops import MLA_DECODE, MLA_PREFILL, STORE_KV, mla_decode, mla_prefill, store_kv

__all__ = ["mla_decode", "mla_prefill", "store_kv", "quantize_kv_fp8", "dequantize_kv_fp8",
           "MLA_DECODE", "MLA_PREFILL", "STORE_KV"]
