"""`nccl` dispatch: torch.distributed all-to-all (NCCL on GPUs, gloo on CPU); any number of ranks.

Dispatch:
1. each token's destination ranks (its experts' owners), de-duplicated: one row per (token, rank);
2. the per-rank row counts are exchanged with each rank's token count (all_to_all_single of [R, 2] int64, then
   one host sync): every rank now knows the largest token count T_max, which keys the tuned config (the chunk
   count must be equal on all ranks) and bounds the chunk count;
3. per chunk of tokens (one chunk: the counts of step 2; more: each chunk's counts exchanged first), one
   all_to_all_single moves packed rows: [topk ids (int32 k) | topk weights (fp32 k) | payload data | payload
   scales], padded to 16 bytes — so a token crosses each link once, whatever the number of its experts on that
   rank;
4. the receiver expands the rows into its expert layout (see `base.expand`).
Combine: the receiver sums its local experts' weighted outputs per row in fp32, sends the row sums
back (bf16 by default, `combine_dtype`), and the sender sums over ranks in fp32.

Low-latency mode has a second exchange, `ll_exchange="fixed"` (its default): every rank sends every
peer exactly num_max_dispatch_tokens_per_rank rows (its tokens bound for that peer first, padding
rows marked by expert id -1 after), so the split sizes are known in advance: no counts exchange,
no host sync, and the decode step (dispatch, experts, combine) can be captured in a CUDA graph.
The price is the padding on the wire when a rank has fewer tokens than the buffer.
`ll_exchange="counts"` uses the normal-mode exchange (exact rows, one host sync). The exchange is chosen when the
dispatcher is built (`construction_knobs`), never from the tuned store: it decides whether decode can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdlab.kernels.registry import register_backend
from pdlab.moe.dispatch.base import BaseDispatcher, DispatchHandle, TokenPayload, expand, reduce_rows
from pdlab.moe.layouts import Layout

_ALIGN = 16
_COMBINE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class _Chunk:
    send_token: torch.Tensor | None  # [n_send] int64, token of each sent row, rank-major order (None: fixed)
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank


@dataclass
class _State:
    expansion: object
    chunks: list[_Chunk]
    row_bytes: int
    back_index: torch.Tensor  # [T, R] int64: row of the combine buffer holding (token, rank), -1 if none


class NcclDispatcher(BaseDispatcher):
    """All-to-all over a torch.distributed process group (the fallback that always exists).

    combine_dtype: "bf16" (default, DeepEP's choice) or "fp32" for the partial sums sent back."""

    name = "nccl"
    construction_knobs = ("ll_exchange",)

    def __init__(self, num_experts: int, hidden_size: int, *, combine_dtype: str = "bf16", **kwargs):
        super().__init__(num_experts, hidden_size, **kwargs)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("nccl dispatch needs torch.distributed initialised (init_process_group with "
                               "nccl on GPUs or gloo on CPU); on one rank use dispatcher='local'")
        if combine_dtype not in _COMBINE_DTYPES:
            raise ValueError(f"combine_dtype must be one of {', '.join(_COMBINE_DTYPES)}, got {combine_dtype!r}")
        self.combine_dtype = _COMBINE_DTYPES[combine_dtype]
        self._dist = dist

    # --- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  mode: str) -> tuple[Layout, DispatchHandle]:
        T, k = topk_ids.shape
        R, dev = self.world_size, tokens.data.device
        dest = topk_ids.long() // self.num_local_experts
        in_rank = torch.zeros((T, R), dtype=torch.bool, device=dev)
        if T:
            in_rank.scatter_(1, dest, True)
        parts = self._wire_parts(tokens, topk_ids, topk_weights)
        row_bytes = sum(p.shape[1] for p in parts)
        pad = (-row_bytes) % _ALIGN
        if pad:
            parts.append(torch.zeros((T, pad), dtype=torch.uint8, device=dev))
        row_bytes += pad
        config = None
        if mode == "low_latency":  # keyed by the buffer's rows per rank, known alike on every rank before any exchange
            config = self.call_config(mode, tokens.kind, k, self.num_max_dispatch_tokens_per_rank, dev)
            if config[0]["ll_exchange"] == "fixed":
                return self._dispatch_fixed(tokens, parts, in_rank, row_bytes, k, config)
        # the whole batch's row counts per rank, each with this rank's token count: every rank learns T_max
        send_counts = in_rank.sum(0)
        first = torch.stack([send_counts, torch.full_like(send_counts, T)], dim=1)  # [R, 2] int64
        recv_first = torch.empty_like(first)
        self._dist.all_to_all_single(recv_first, first, group=self.group)
        counts = torch.stack([first[:, 0], recv_first[:, 0], recv_first[:, 1]]).cpu().tolist()  # host sync
        t_max = max(counts[2])
        if config is None:
            config = self.call_config(mode, tokens.kind, k, t_max, dev)
        # equal on every rank (T_max and the config are): a rank with fewer tokens sends empty chunks
        num_chunks = max(1, min(int(config[0]["num_chunks"]), t_max))
        bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
        packed = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [T, row_bytes] uint8
        chunks, received, sent_rows, back_rows = [], [], 0, 0
        back_index = torch.full((T, R), -1, dtype=torch.long, device=dev)
        sent_before = 0
        for t0, t1 in zip(bounds[:-1], bounds[1:]):
            m = in_rank[t0:t1]
            if num_chunks == 1:
                splits = counts[:2]
            else:
                send_counts = m.sum(0)
                recv_counts = torch.empty_like(send_counts)
                self._dist.all_to_all_single(recv_counts, send_counts, group=self.group)
                splits = torch.stack([send_counts, recv_counts]).cpu().tolist()  # one host sync per chunk
            n_send = sum(splits[0])
            # rank-major send order: (token t, rank r) goes to row start[r] + #(earlier tokens bound for r)
            start = torch.cumsum(send_counts, 0) - send_counts  # the whole batch's counts when one chunk
            row = torch.where(m, torch.cumsum(m, 0) - 1 + start, n_send)  # n_send = a dummy slot
            send_token = torch.empty(n_send + 1, dtype=torch.long, device=dev)
            send_token[row.flatten()] = torch.arange(t0, t1, device=dev)[:, None].expand(t1 - t0, R).flatten()
            send_token = send_token[:n_send]
            back_index[t0:t1] = torch.where(m, row + sent_before, -1)
            sent_before += n_send
            rows = packed.index_select(0, send_token)
            recv = torch.empty((sum(splits[1]), row_bytes), dtype=torch.uint8, device=dev)
            self._dist.all_to_all_single(recv, rows, splits[1], splits[0], group=self.group)
            chunks.append(_Chunk(send_token, splits[0], splits[1]))
            received.append(recv)
            sent_rows += n_send - splits[0][self.rank]
            back_rows += sum(splits[1]) - splits[1][self.rank]
        recv = received[0] if len(received) == 1 else torch.cat(received)
        recv_tokens, recv_ids, recv_w = self._unpack(recv, tokens, k)
        layout, exp = expand(recv_tokens, recv_ids, recv_w, self.expert_start, self.num_local_experts, mode,
                             self.max_m())
        out_dtype = tokens.source.dtype if tokens.source is not None else torch.bfloat16
        back_bytes = back_rows * self.hidden_size * self.combine_dtype.itemsize
        return layout, self._handle(mode, layout, T, out_dtype, _State(exp, chunks, row_bytes, back_index),
                                    bytes_sent=sent_rows * row_bytes, bytes_back=back_bytes, config=config)

    def _dispatch_fixed(self, tokens: TokenPayload, parts: list[torch.Tensor], in_rank: torch.Tensor,
                        row_bytes: int, k: int, config: tuple[dict, str]) -> tuple[Layout, DispatchHandle]:
        """Low-latency exchange without a host sync: [R, Tm] rows to and from every rank.

        parts: byte views [T, b] of each row (ids first); in_rank: [T, R] bool, token t bound for
        rank r. Row (r, i) of the send buffer is the i-th token bound for rank r; the rest of the
        Tm rows keep ids -1 (all bytes 0xFF), which `expand` treats as bound for no local expert."""
        T, R = in_rank.shape
        Tm, dev = self.num_max_dispatch_tokens_per_rank, in_rank.device
        send = torch.full((R * Tm + 1, row_bytes), 0xFF, dtype=torch.uint8, device=dev)  # + 1 dummy row
        slot = torch.cumsum(in_rank, 0) - 1  # [T, R] the token's row among those bound for r
        dst = torch.arange(R, device=dev) * Tm + slot
        back_index = torch.where(in_rank, dst, -1)
        if T:
            packed = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [T, row_bytes]
            rows = torch.where(in_rank, dst, R * Tm).flatten()  # pairs not bound go to the dummy row
            send.index_copy_(0, rows, packed.repeat_interleave(R, dim=0))
        recv = torch.empty((R * Tm, row_bytes), dtype=torch.uint8, device=dev)
        self._dist.all_to_all_single(recv, send[:R * Tm], group=self.group)
        recv_tokens, recv_ids, recv_w = self._unpack(recv, tokens, k)
        layout, exp = expand(recv_tokens, recv_ids, recv_w, self.expert_start, self.num_local_experts,
                             "low_latency", self.max_m())
        splits = [Tm] * R
        out_dtype = tokens.source.dtype if tokens.source is not None else torch.bfloat16
        peers_rows = (R - 1) * Tm
        return layout, self._handle("low_latency", layout, T, out_dtype,
                                    _State(exp, [_Chunk(None, splits, splits)], row_bytes, back_index),
                                    bytes_sent=peers_rows * row_bytes,
                                    bytes_back=peers_rows * self.hidden_size * self.combine_dtype.itemsize,
                                    config=config)

    @staticmethod
    def _wire_parts(tokens: TokenPayload, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> list[torch.Tensor]:
        """Byte views [T, b] of everything one row carries (ids and weights first: 4-byte aligned)."""
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.float().contiguous()
        return [ids.view(torch.uint8), w.view(torch.uint8)] + [p.contiguous().view(torch.uint8) for p in tokens.parts()]

    @staticmethod
    def _unpack(recv: torch.Tensor, like: TokenPayload, k: int
                ) -> tuple[TokenPayload, torch.Tensor, torch.Tensor]:
        col = 0

        def take(nbytes: int, dtype: torch.dtype, width: int) -> torch.Tensor:
            nonlocal col
            out = recv[:, col:col + nbytes].view(dtype)
            col += nbytes
            return out if out.shape[1] == width else out.reshape(recv.shape[0], width)

        ids = take(4 * k, torch.int32, k)
        w = take(4 * k, torch.float32, k)
        d = like.data
        data = take(d.shape[1] * d.element_size(), d.dtype, d.shape[1])
        scales = None
        if like.scales is not None:
            s = like.scales
            scales = take(s.shape[1] * s.element_size(), s.dtype, s.shape[1])
        return TokenPayload(like.kind, data, scales, like.global_scale), ids, w

    # --- combine ------------------------------------------------------------------------------

    def _combine(self, y: Layout, handle: DispatchHandle) -> torch.Tensor:
        from pdlab.moe.dispatch._reduce import gather_reduce

        state: _State = handle.state
        impl, chunk_rows = handle.config["reduce_impl"], int(handle.config["chunk_rows"])
        partial = reduce_rows(y, state.expansion, chunk_rows, self.combine_dtype, impl)
        H = partial.shape[1]
        back = torch.empty((sum(sum(c.send_splits) for c in state.chunks), H), dtype=partial.dtype,
                           device=partial.device)
        r0 = s0 = 0
        for chunk in state.chunks:
            n_recv, n_send = sum(chunk.recv_splits), sum(chunk.send_splits)
            # sent as bytes: gloo has no bf16 all-to-all
            self._dist.all_to_all_single(back[s0:s0 + n_send].view(torch.uint8),
                                         partial[r0:r0 + n_recv].view(torch.uint8),
                                         chunk.send_splits, chunk.recv_splits, group=self.group)
            r0, s0 = r0 + n_recv, s0 + n_send
        return gather_reduce(back, state.back_index, None, handle.out_dtype, impl=impl, chunk_rows=chunk_rows)


def _probe() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


@register_backend("moe_dispatch", "nccl", archs=("cpu", "cuda"), probe=_probe, priority=20,
                  config_space={"num_chunks": [1, 2, 4], "reduce_impl": ["triton", "torch"],
                                "chunk_rows": [2048, 4096, 8192]},
                  default_config={"num_chunks": 1, "reduce_impl": "auto", "chunk_rows": 4096,
                                  "ll_exchange": "fixed"},
                  options={"modes": ("normal", "low_latency"), "payloads": ("bf16", "fp8", "nvfp4"),
                           "layouts": ("contiguous", "masked"), "dedup_per_rank": True,
                           "needs_process_group": True})
def create_nccl(num_experts: int, hidden_size: int, **kwargs) -> NcclDispatcher:
    """torch.distributed all_to_all_single (NCCL on GPUs, gloo on CPU), counts exchanged first."""
    return NcclDispatcher(num_experts, hidden_size, **kwargs)
