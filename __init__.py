"""pdlab: kernels for serving DeepSeek-style models (MLA attention + NVFP4 MoE) with prefill/decode
disaggregation, used three ways: `bench` measures them, `tune` searches their configurations,
`runtime serve` assembles them into prefill, decode and colocated servers."""

__version__ = "0.1.0"
