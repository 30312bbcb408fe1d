"""A small test model and byte tokenizer with the model interface of `pdlab.runtime.model`, for
testing the engine, scheduler, server and disaggregation without the real model.

`ToyModel.forward(input_ids [T] int64, positions [T] int64, ctx) -> logits [B, V] fp32` writes each
new token's latent row into every layer's paged pool (bf16/fp32, or fp8 bytes with ctx.kv_scale),
then for each sequence attends from its last token over all rows read back through the block table (an empty
sequence, length 0, gets zero logits).
Logits therefore depend on the whole token history as stored in the KV pool: a page lost, misplaced
or corrupted by retraction, backup or transfer changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LATENT = 576


@dataclass
class ToyConfig:
    num_hidden_layers: int = 2
    vocab_size: int = 257  # 256 bytes + EOS
    max_position_embeddings: int = 1024
    eos_token_id: int = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 is EOS."""

    eos_token_id = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ToyModel:
    def __init__(self, cfg: ToyConfig | None = None, seed: int = 0, device: str | torch.device = "cpu"):
        self.config = cfg or ToyConfig()
        g = torch.Generator().manual_seed(seed)
        V = self.config.vocab_size
        self.device = torch.device(device)
        self.emb = torch.randn(V, LATENT, generator=g).to(self.device)
        self.freq = (torch.rand(LATENT, generator=g) * 0.5).to(self.device)
        self.out = (torch.randn(LATENT, V, generator=g) / LATENT ** 0.5).to(self.device)
        self.calls = 0

    def latent(self, ids: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """The KV row each token stores at `layer`: ids [T] int64, pos [T] int64 → [T, LATENT] fp32."""
        return (self.emb[ids] + torch.sin(pos[:, None].float() * self.freq[None, :])) * (1.0 + 0.25 * layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 → logits [B, V] fp32, one row per sequence of ctx (B =
        ctx.seqlens.shape[0]): stores each token's KV, then reads every stored row of its sequence back, so that a
        lost, misplaced or corrupted row changes the logits."""
        self.calls += 1
        ps = ctx.page_size
        for layer, cache in enumerate(ctx.kv_caches):
            _store(cache, ctx.slots, self.latent(input_ids, positions, layer), ctx.kv_scale)
        B = ctx.seqlens.shape[0]
        logits = []
        for b in range(B):
            n = int(ctx.seqlens[b])
            if n == 0:  # an empty sequence (prefill-graph padding): no row to attend to
                logits.append(torch.zeros(self.out.shape[1], device=self.device))
                continue
            pages = ctx.block_table[b, : -(-n // ps)].long()
            q = None
            h = torch.zeros(LATENT, device=self.device)
            for layer, cache in enumerate(ctx.kv_caches):
                rows = _load(cache[pages].reshape(-1, LATENT)[:n], ctx.kv_scale)
                q = rows[-1] if q is None else q
                attn = torch.softmax(rows @ q / LATENT ** 0.5 / (1.0 + 0.25 * layer) ** 2, dim=0)
                # NOTE: attention alone is dominated by each token's own row; the position-weighted
                # mean over every stored row makes one lost, misplaced or corrupted row change the logits.
                w = torch.linspace(1.0, 2.0, n, device=rows.device)
                h = h + attn @ rows + 3.0 * (w[:, None] * rows).sum(0) / w.sum()
            logits.append(h @ self.out * 4.0)
        return torch.stack(logits).float()


def load_toy(path=None, device="cpu", dtype=None, seed: int = 0, **cfg):
    """Same shape as `pdlab.runtime.model.load_model`: (model, tokenizer, config)."""
    config = ToyConfig(**cfg)
    return ToyModel(config, seed, device), ByteTokenizer(), config


def _store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, kv_scale) -> None:
    keep = slots >= 0
    flat = cache.view(-1, LATENT)
    if cache.dtype == torch.uint8:
        data = (rows / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        data = rows.to(cache.dtype)
    flat[slots[keep]] = data[keep]


def _load(rows: torch.Tensor, kv_scale) -> torch.Tensor:
    if rows.dtype == torch.uint8:
        return rows.view(torch.float8_e4m3fn).float() * kv_scale
    return rows.float()
