"""MLA backends, one file each; importing this package registers them all (vendor packages are
imported lazily inside the calls, so a missing one only makes its backend unavailable)."""

from pdlab.attention.backends import flashinfer_mla, flashmla, reference, triton_mla, trtllm_mla  # noqa: F401
