"""The router role: OpenAI-compatible front over prefill/decode server pairs."""
