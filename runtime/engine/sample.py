"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seed, logprobs.

Vectorised over the batch with no per-request host syncs. Randomness is Gumbel-max with noise from a
counter hash of (request seed, output position, token id) computed on the device, so a seeded
request samples the same tokens whatever batch it shares and whichever device runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdlab.runtime.core import INF_LOGITS, NAN_LOGITS, NO_FINITE_LOGIT, Req

_M32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row settings of a batch of B sampled requests (device tensors) plus host-known flags.

    temperature/top_p/min_p: [B] fp32; top_k: [B] int64 (vocab size = off); seed: [B] int64;
    step: [B] int64 (index of the token being sampled in the request's output)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    all_greedy: bool
    any_filter: bool
    max_logprobs: int  # -1 = no logprobs requested in this batch

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device,
                  steps: list[int] | None = None) -> "SamplingTensors":
        """The [B] tensors of `reqs` (B = len(reqs)) on `device`. steps: the output index each row samples (default:
        len(output_ids); a decode step launched before the previous step's token reached the host samples one
        further)."""
        ps = [r.params for r in reqs]
        pin = device.type == "cuda"
        steps = [len(r.output_ids) for r in reqs] if steps is None else steps
        f = torch.tensor([[p.temperature, p.top_p, p.min_p] for p in ps], dtype=torch.float32, pin_memory=pin)
        i = torch.tensor([[min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size, r.seed & ((1 << 63) - 1), s]
                          for p, r, s in zip(ps, reqs, steps)], dtype=torch.int64, pin_memory=pin)
        f, i = f.to(device, non_blocking=True), i.to(device, non_blocking=True)
        return cls(temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], top_k=i[:, 0], seed=i[:, 1], step=i[:, 2],
                   all_greedy=all(p.greedy for p in ps),
                   any_filter=any((0 < p.top_k < vocab_size) or p.top_p < 1.0 or p.min_p > 0.0 for p in ps if not p.greedy),
                   max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1))


@dataclass
class SampleOutput:
    """next_ids: [B] int64, always in the vocabulary (a chained decode step feeds them to the model). checked_ids:
    [B] int64, next_ids with a negative code (`pdlab.runtime.core.NAN_LOGITS`, ...) in each row whose logits cannot be
    sampled: what the host reads. chosen_logprobs: [B] fp32 or None. top_ids/top_logprobs: [B, n] or None
    (n = the largest `logprobs` asked in the batch). Logprobs are of the model's distribution
    (log_softmax of the logits, before temperature and filters)."""

    next_ids: torch.Tensor
    checked_ids: torch.Tensor
    chosen_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def greedy(logits: torch.Tensor) -> SampleOutput:
    """The argmax of each row of logits [B, V] (any float dtype): a batch of greedy requests without logprobs needs
    no per-row settings."""
    ids = logits.argmax(dim=-1)
    return SampleOutput(next_ids=ids, checked_ids=check_logits(logits, ids, ids))


def check_logits(logits: torch.Tensor, argmax_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """next_ids [B] int64 with each row whose logits [B, V] cannot be sampled replaced by a negative code: NAN_LOGITS
    (a NaN), INF_LOGITS (a +inf) or NO_FINITE_LOGIT (every logit -inf). argmax_ids: [B] int64, the argmax of each row
    (argmax propagates NaN, so the value there is the row's fault if it has one). A gather and three element-wise
    ops over [B], no host sync: the codes reach the host with the tokens."""
    top = logits.gather(1, argmax_ids[:, None])[:, 0]
    code = top.nan_to_num(nan=NAN_LOGITS, posinf=INF_LOGITS, neginf=NO_FINITE_LOGIT).to(torch.int64)
    return torch.where(top.isfinite(), next_ids, code)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SampleOutput:
    """logits: [B, V] fp32 (one row per sampled request). Returns the next token of each row; rows whose logits
    cannot be sampled are flagged in `checked_ids` (see `check_logits`)."""
    if logits.dim() != 2 or logits.shape[0] != st.temperature.shape[0]:
        raise ValueError(f"sample(): logits must be [B, V] with B={st.temperature.shape[0]} rows, got {tuple(logits.shape)}")
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        next_ids = greedy_ids
    else:
        temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        scaled = logits / temp[:, None]
        if st.any_filter:
            scaled = _apply_filters(scaled, st)
        noise = gumbel_noise(st.seed, st.step, logits.shape[1])
        sampled = (scaled + noise).argmax(dim=-1)
        next_ids = torch.where(st.temperature > 0, sampled, greedy_ids)
    out = SampleOutput(next_ids=next_ids, checked_ids=check_logits(logits, greedy_ids, next_ids))
    if st.max_logprobs >= 0:
        lp = torch.log_softmax(logits, dim=-1)
        out.chosen_logprobs = lp.gather(1, next_ids[:, None])[:, 0]
        if st.max_logprobs > 0:
            out.top_logprobs, out.top_ids = lp.topk(st.max_logprobs, dim=-1)
    return out


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] fp32 Gumbel(0, 1) noise, a pure function of (seed [B] int64, step [B] int64, token id)."""
    tok = torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :]
    lo, hi = seed & _M32, (seed >> 32) & _M32
    x = _fmix32((lo ^ ((step * 0x9E3779B9) & _M32))[:, None] ^ ((tok * 0x85EBCA6B) & _M32))
    x = _fmix32(x ^ hi[:, None])
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24-bit values: exact in fp32, u in (0, 1)
    return -torch.log(-torch.log(u))


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on values in [0, 2**32); int64 products wrap, the low 32 bits stay exact
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _apply_filters(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, top-p nucleus and min-p floor."""
    vals, _ = scaled.sort(dim=-1, descending=True)
    V = scaled.shape[1]
    rank = torch.arange(V, device=scaled.device)[None, :]
    keep = rank < st.top_k[:, None]
    probs = torch.softmax(vals, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    keep &= before < st.top_p[:, None]
    keep &= probs >= st.min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    n_keep = keep.sum(dim=-1)  # kept set is a prefix of the sorted order
    threshold = vals.gather(1, (n_keep - 1)[:, None])
    return scaled.masked_fill(scaled < threshold, float("-inf"))
