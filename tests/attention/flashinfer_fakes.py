"""Pieces of the fake flashinfer modules the CPU adapter tests install: the 0.7 metadata class and an attention
that computes MLA in fp32 from CSR metadata exactly as given (what the real kernel reads)."""

import torch


class CsrMetadata:
    """flashinfer.mla.MLAPlanMetadata: `csr(...)` keeps its four tensors in `t`."""

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        m = cls()
        m.t = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        return m


def attend(query, kv_cache, qo, kv_indptr, kv_indices, kv_len, causal, scale):
    """query [n, H, 576], kv_cache [pages, page, 576]; qo, kv_indptr, kv_indices, kv_len as lists; sequence s has
    rows qo[s]:qo[s + 1] over its pages kv_indices[kv_indptr[s]:kv_indptr[s + 1]], its first kv_len[s] tokens
    (causal: row i of n sees positions <= kv_len[s] - n + i) → (out [n, H, 512] query.dtype, lse [n, H] fp32)."""
    out = torch.zeros(query.shape[0], query.shape[1], 512)
    lse = torch.zeros(query.shape[0], query.shape[1])
    for s in range(len(kv_len)):
        kv = kv_cache[kv_indices[kv_indptr[s]:kv_indptr[s + 1]]].reshape(-1, 576)[:kv_len[s]].float()
        q = query[qo[s]:qo[s + 1]].float()
        logits = torch.einsum("nhd,ld->nhl", q, kv) * scale
        if causal:
            n = q.shape[0]
            last = kv_len[s] - n + torch.arange(n)
            logits = logits.masked_fill(torch.arange(kv_len[s])[None, None, :] > last[:, None, None], -torch.inf)
        lse[qo[s]:qo[s + 1]] = torch.logsumexp(logits, -1)
        out[qo[s]:qo[s + 1]] = torch.softmax(logits, -1) @ kv[:, :512]
    return out.to(query.dtype), lse
