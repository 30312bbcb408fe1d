"""Prefill/decode disaggregation: KV transfer, roles, bootstrap, launch."""
