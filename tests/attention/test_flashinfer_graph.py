"""flashinfer decode inside the runtime's replayed CUDA graphs, checked on CPU with a fake flashinfer whose
CUDA-graph mode behaves as the real one: plan() takes host metadata and copies it into the caller's fixed buffers,
run() attends from whatever those buffers hold when it runs (as a replayed kernel does), and the plan info (what
a captured launch holds) comes from the shape. A replay is emulated by running the captured device step (the page
fill and run) again on the same tensors after the capture's `replan`."""

import sys
import types
from pathlib import Path

import pytest
import torch

from pdlab.attention import mla_decode, ops
from pdlab.attention.workloads import decode_problem
from pdlab.kernels import registry

sys.path.insert(0, str(Path(__file__).parent))
from flashinfer_fakes import CsrMetadata, attend  # noqa: E402


def _graph_fake_flashinfer(monkeypatch, info_of=None, fast=False):
    """Install the fake; info_of(plan_number, num_heads) → plan info (default: from the shape only). fast: the
    planned wrapper exposes its backend's generated module as flashinfer 0.7 does (`_planned_backend`), whose
    plan the adapter may call directly for re-plans (logged under "module_plans")."""
    log = {"plans": [], "wrappers": [], "module_plans": []}

    def compiled_plan(fws, iws, pinned, qo, kv_indptr, kv_len, num_heads, dckv, causal):
        """The compiled plan: host metadata in, the schedule written into the pinned buffer, (info, staged bytes)."""
        assert qo.device.type == kv_indptr.device.type == kv_len.device.type == "cpu"
        log["module_plans"].append([t.tolist() for t in (qo, kv_indptr, kv_len)] + [num_heads, dckv, causal])
        pinned[:8] = torch.tensor(kv_indptr.tolist()[:8] + [0] * (8 - min(8, kv_indptr.numel())), dtype=torch.uint8)
        return [2 if num_heads > 64 else 1, 132, 0, 64], 8

    class Module:  # the generated module's wrapper (and, with fast == "raw", the compiled module under it)
        def __init__(self):
            if fast == "raw":
                self._module = types.SimpleNamespace(plan=compiled_plan)

        def plan_with_staged_workspace_bytes(self, fws, iws, pinned, *args):
            info, staged = compiled_plan(fws, iws, pinned, *args)
            iws[:staged].copy_(pinned[:staged])
            return info, staged

    class PlannedBackend:
        def __init__(self):
            self._cached_module = Module()
            self._float_workspace_buffer = None
            self._int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)
            self._pin_memory_int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)
            log["int_workspace"] = self._int_workspace_buffer

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                     kv_len_arr=None, backend="auto"):
            assert use_cuda_graph, "the graph path builds graph-mode wrappers only"
            self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
            log["wrappers"].append(self)

        def plan(self, *, metadata, num_heads, causal, sm_scale, page_size, **kw):
            qo, kv_indptr, kv_indices, kv_len = metadata.t
            # the host metadata flashinfer's scheduler reads: on the device it would cost a sync every step
            assert qo.device.type == kv_indptr.device.type == kv_len.device.type == "cpu"
            qo_buf, indptr_buf, indices_buf, len_buf = self.bufs
            assert kv_indices.data_ptr() == indices_buf.data_ptr() and kv_indices.numel() == int(kv_indptr[-1])
            qo_buf.copy_(qo)
            indptr_buf.copy_(kv_indptr)
            len_buf.copy_(kv_len)
            n = len(log["plans"])
            log["plans"].append([t.tolist() for t in (qo, kv_indptr, kv_len)])
            self.meta = (causal, sm_scale)
            info = info_of(n, num_heads) if info_of else [2 if num_heads > 64 else 1, 132, 0, 64]
            if fast:
                self._planned_backend = PlannedBackend()
                self._planned_backend._plan_info = info
            else:
                self._plan_info = info

        def run(self, *, query, kv_cache, return_lse, return_lse_base_on_e):
            qo, kv_indptr, kv_indices, kv_len = (t.tolist() for t in self.bufs)  # read at run time: a replay
            return attend(query, kv_cache, qo, kv_indptr, kv_indices, kv_len, *self.meta)

    for name, attrs in (("flashinfer", {}), ("flashinfer.mla", dict(
            BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper, MLAPlanMetadata=CsrMetadata))):
        mod = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, name, mod)
    return log


@pytest.fixture
def fresh(monkeypatch):
    from pdlab.attention.backends import flashinfer_mla

    for name in ("_WRAPPERS", "_GRAPH_PLANS", "_GRAPH_WORKSPACES", "_PINNED_RINGS"):
        monkeypatch.setattr(flashinfer_mla, name, {})
    monkeypatch.setattr(ops, "_SELECTED", {})
    monkeypatch.setitem(registry._PROBE_CACHE, ("mla_decode", "flashinfer", registry.detect_arch()), None)
    return flashinfer_mla


def _poison_past(p, lens):
    """NaN in every cache row at a position >= lens[b] of sequence b (a kernel reading one shows in its output)."""
    page = p.kv_cache.shape[1]
    for b, n in enumerate(lens):
        for pos in range(n, p.block_table.shape[1] * page):
            p.kv_cache[p.block_table[b, pos // page], pos % page] = float("nan")


@pytest.mark.parametrize("fast", [False, "module", "raw"])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (16, 2)])
def test_replanned_graph_decode_equals_the_reference_on_new_lengths_and_tables(monkeypatch, fresh, heads, q_len,
                                                                               fast):
    """Captured on the capture's lengths, replayed on others (longer, shorter, other pages): after `replan` the
    captured device step reads the new pages and lengths and equals the torch reference; pages past each new
    length (NaN) are never read. One plan and one page fill per step, however many layers call. fast: the
    re-plan goes below the wrapper (flashinfer 0.7): through the generated module's wrapper ("module") or the
    compiled plan ("raw", its schedule copied from a pinned ring buffer into the integer workspace), and the
    adapter fills the fixed buffers."""
    log = _graph_fake_flashinfer(monkeypatch, fast=fast)
    flash = registry.get_backend("mla_decode", "flashinfer")
    p = decode_problem([9, 30, 5], heads=heads, q_len=q_len, page=16, dtype=torch.bfloat16, capacity=64,
                       poison=False, seed=1)
    fills = []
    real_fill = fresh._GraphPlan.fill_pages

    def counting_fill(self, bt, sl, cap=None):  # counts the fills that wrote pages (later layers' calls reuse them)
        before = self._filled
        real_fill(self, bt, sl, cap)
        if self._filled is not before:
            fills.append(1)

    monkeypatch.setattr(fresh._GraphPlan, "fill_pages", counting_fill)
    with ops.replayed_graph_capture(p.seqlens.clone()) as cap:
        for _layer in range(3):
            out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    assert len(cap) == 1 and len(log["plans"]) == 1 and len(log["wrappers"]) == 1
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, backend="torch")
    torch.testing.assert_close(out.float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref[1], atol=1e-3, rtol=1e-3)

    # a replay: new lengths and a permuted table written into the captured tensors, the host lengths re-planned
    new = [47, 2 * q_len, 33]
    p.block_table.copy_(p.block_table.flip(0))
    p.seqlens.copy_(torch.tensor(new, dtype=torch.int32))
    _poison_past(p, new)
    p.q.copy_(torch.randn(p.q.shape).to(p.q.dtype))
    cap.replan(torch.tensor(new, dtype=torch.int32))
    replan = log["module_plans"][-1] if fast else log["plans"][-1]
    assert len(log["plans"]) == (1 if fast else 2) and len(log["module_plans"]) == (1 if fast else 0)
    assert replan[1] == [0, 3, 4, 7] and replan[2] == new  # ceil(47/16), ceil(2/16), ceil(33/16) pages
    if fast:
        assert replan[0] == [q_len * i for i in range(4)] and replan[3:] == [heads, 512, q_len > 1]
        assert log["int_workspace"][:8].tolist() == [0, 3, 4, 7, 0, 0, 0, 0]  # the staged schedule arrived
    plan = next(iter(fresh._GRAPH_PLANS.values()))
    kv = p.kv_cache
    plan.fill_pages(p.block_table, p.seqlens, cap)  # the captured device step, in order
    out2, lse2 = fresh._run(plan, p.q.reshape(-1, heads, 576), kv)
    ref2 = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, backend="torch")
    B = len(new)
    torch.testing.assert_close(out2.view(B, q_len, heads, 512).float(), ref2[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse2.view(B, q_len, heads).transpose(1, 2), ref2[1], atol=1e-3, rtol=1e-3)
    assert torch.isfinite(out2.float()).all()
    assert len(fills) == 2  # one for the capture's three layers, one for the replay's new table


def test_fill_pages_is_the_csr_of_the_block_table():
    """The graph's page fill equals the eager CSR (`_csr_pages`) for ragged lengths, including a length of a whole
    table and rows of one token; unused entries go to the sink only."""
    from pdlab.attention.backends.flashinfer_mla import _csr_pages, _GraphPlan

    plan = _GraphPlan.__new__(_GraphPlan)
    B, W, page = 5, 6, 8
    plan.page, plan.max_pages, plan._filled = page, W, None
    plan.kv_indices = torch.full((B * W + 1,), -7, dtype=torch.int32)
    plan._cols = torch.arange(W)
    table = torch.randperm(B * W + 4)[: B * W].view(B, W).to(torch.int32)
    lens = torch.tensor([1, 48, 17, 8, 9], dtype=torch.int32)
    plan.fill_pages(table, lens)
    indptr, indices = _csr_pages(table, lens, page)
    assert plan.kv_indices[: indices.numel()].tolist() == indices.tolist()
    assert plan.kv_indices[indices.numel():-1].eq(-7).all()  # untouched past the live pages
    # both share one fill: against the CSR written out by hand (pages 1, 6, 3, 1, 2)
    expected = [row[:-(-n // page)] for row, n in zip(table.tolist(), lens.tolist())]
    assert indices.tolist() == sum(expected, []) and indptr.tolist() == [0, 1, 7, 10, 11, 13]


def test_a_changed_plan_info_is_an_error_not_a_stale_replay(monkeypatch, fresh):
    """The captured launch holds flashinfer's plan info: a re-plan that changes it raises (and says what to do)."""
    _graph_fake_flashinfer(monkeypatch, info_of=lambda n, heads: [1, 132, n])
    p = decode_problem([9, 30], heads=16, page=16, dtype=torch.bfloat16, poison=False)
    with ops.replayed_graph_capture(p.seqlens.clone()) as cap:
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    with pytest.raises(RuntimeError, match="stale schedule.*disable-cuda-graph"):
        cap.replan(torch.tensor([10, 31], dtype=torch.int32))


def test_replan_refuses_lengths_that_do_not_fit_the_capture(monkeypatch, fresh):
    _graph_fake_flashinfer(monkeypatch)
    p = decode_problem([9, 30], heads=16, page=16, dtype=torch.bfloat16, capacity=32, poison=False)
    with ops.replayed_graph_capture(p.seqlens.clone()) as cap:
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    for bad, why in (([9, 33], "pages"), ([9, 30, 1], "B=2"), ([0, 3], "S_q")):
        with pytest.raises(ValueError, match=why):
            cap.replan(torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match="host tensor"):
        ops.ReplayedCapture(torch.ones(2, dtype=torch.int64))


def test_selection_in_replayed_captures(monkeypatch, fresh):
    """flashinfer decode is taken into a replayed capture that knows its host lengths; into one that does not it
    is skipped (naming it raises and says what to do); its prefill (no graph re-plan) is never taken into one."""
    _graph_fake_flashinfer(monkeypatch)
    p = decode_problem([9, 30], heads=16, page=16, dtype=torch.bfloat16, poison=False)
    sel = lambda: ops._select(ops.MLA_DECODE, None, p.q, p.kv_cache, q_len=1).name  # noqa: E731
    assert sel() == "flashinfer"
    with ops.replayed_graph_capture():
        assert sel() != "flashinfer"
        with pytest.raises(RuntimeError, match="replayed_graph_capture\\(seqlens\\)"):
            mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, backend="flashinfer")
    with ops.replayed_graph_capture(p.seqlens.clone()):
        assert sel() == "flashinfer"
        prefill = registry.get_backend("mla_prefill", "flashinfer")
        assert "cannot re-plan" in ops.supports(prefill, page_size=16, kv_dtype="bf16", q_dtype="bf16", q_len=None,
                                                replayed=True, replan=True)
    assert ops.current_replayed_capture() is None
