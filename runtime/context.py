"""The per-step forward context: the one object through which a step's attention metadata reaches
the model's layers. The engine builds it before a forward and drops it after; layers only read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Metadata of one forward step over a batch of B sequences and T new tokens.

    is_decode: every sequence adds exactly `q_len` tokens (decode / speculative decode); else
        prefill/extend (ragged new tokens, causal among them, attending to the cached prefix).
    block_table: [B, max_pages] int32, page ids of each sequence in the KV pools (unused: any value).
    seqlens: [B] int32, tokens per sequence after this step (cached prefix + new tokens).
    qo_indptr: [B + 1] int32, cumulative new-token counts (T = qo_indptr[-1]).
    slots: [T] int64, KV slot (page * page_size + offset) each new token writes; -1 = skip (padding).
    logits_indices: [B] int64, index into the T tokens of the token whose logits are sampled
        (each sequence's last new token).
    kv_caches: one pool per layer, [num_pages, page_size, 576], bf16 | uint8 (fp8_e4m3 bytes).
    kv_scale: per-tensor dequant scale of fp8 pools (None for bf16).
    max_q_len: max new tokens of one sequence in this step (host int, no sync needed).
    q_len: new tokens per sequence in decode steps (1, or 2/4 with speculative decoding).
    """

    is_decode: bool
    block_table: torch.Tensor
    seqlens: torch.Tensor
    qo_indptr: torch.Tensor
    slots: torch.Tensor
    logits_indices: torch.Tensor
    kv_caches: list[torch.Tensor]
    kv_scale: float | None
    max_q_len: int
    q_len: int = 1

    @property
    def page_size(self) -> int:
        return self.kv_caches[0].shape[1]
