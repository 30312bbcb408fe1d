"""The A/B of 960f6d1's two prefill changes, interleaved step by step in one process (run at tree 960f6d1; the
prepare change was reverted after it, in 67d2902). prep_old: prepare() as before 960f6d1 (one host-to-device copy
per tensor); prep_new: one pinned asynchronous copy. sync: the local dispatcher's normal mode reads the row count
back (expand(all_local=False): one sync per MoE layer, counts by scatter_add); nosync: T·k rows, no sync."""
import statistics, sys, time
import numpy as np
import torch
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.engine import Engine, ForwardContext
from pdlab.runtime.core import Req, SamplingParams
import pdlab.moe.dispatch.local as local_mod


def old_prepare(self, batch, input_ids=None):
    reqs, ext = batch.reqs, batch.extend_lens
    ps = self.page_size
    ids, pos, slots = [], [], []
    for r, n in zip(reqs, ext):
        ids.extend(r.tokens(r.cached_len, r.cached_len + n))
        p = np.arange(r.cached_len, r.cached_len + n, dtype=np.int64)
        pos.append(p)
        slots.append(np.asarray(r.pages, dtype=np.int64)[p // ps] * ps + p % ps)
    lens = np.asarray(ext, dtype=np.int64)
    seqlens = np.asarray([r.cached_len + n for r, n in zip(reqs, ext)], dtype=np.int32)
    qo = np.zeros(len(reqs) + 1, dtype=np.int32)
    qo[1:] = np.cumsum(lens)
    d = self.device
    max_pages = int(max(-(-s // ps) for s in seqlens))
    rows = torch.tensor([r.table_row for r in reqs], dtype=torch.int64, device=d)
    ctx = ForwardContext(
        is_decode=False, block_table=self.page_table.table[rows, :max_pages],
        seqlens=torch.from_numpy(seqlens).to(d), qo_indptr=torch.from_numpy(qo).to(d),
        slots=torch.from_numpy(np.concatenate(slots)).to(d),
        logits_indices=torch.from_numpy(qo[1:].astype(np.int64) - 1).to(d),
        kv_caches=self.pool.kv_caches, kv_scale=self.pool.kv_scale, max_q_len=int(lens.max()))
    return (torch.tensor(ids, dtype=torch.int64).to(d), torch.from_numpy(np.concatenate(pos)).to(d), ctx)


new_prepare = Engine.prepare
new_expand = local_mod.expand


def sync_expand(*a, **k):
    k["all_local"] = False
    return new_expand(*a, **k)


def step_ms(llm, n, i):
    s = llm.scheduler
    s.add_request(Req([(7 * i + j) % 500 + 3 for j in range(n)], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    torch.cuda.synchronize(); t0 = time.perf_counter(); s.step(); torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) * 1e3
    while s.has_work: s.step()
    return dt


model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "tiny" else None
llm = LLM(model_path=model, device="cuda", page_size=64, max_total_tokens=65536, max_context_len=8192, max_running_requests=16, cuda_graph_bs=[1])
llm.scheduler.warmup()
variants = {"prep_old+sync": (old_prepare, sync_expand), "prep_new+sync": (new_prepare, sync_expand),
            "prep_old+nosync": (old_prepare, new_expand), "prep_new+nosync": (new_prepare, new_expand)}
for n in (16, 128, 512, 2048):
    res = {k: [] for k in variants}
    for i in range(25):
        for k, (prep, exp) in variants.items():
            Engine.prepare = prep; local_mod.expand = exp
            res[k].append(step_ms(llm, n, i))
    print(f"{model or 'tiny'} {n:5d} tokens: " + "  ".join(f"{k} {statistics.median(v):6.2f}" for k, v in res.items()), flush=True)
