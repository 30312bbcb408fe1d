"""Vendor adapters (flashmla, trtllm_mla, flashinfer) checked on CPU: a fake vendor module in
sys.modules records the exact tensors and arguments each adapter passes (layouts, dtypes, scales,
workspace, metadata API generation, plan reuse)."""

import inspect
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from pdlab.attention import mla_decode, mla_prefill
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.kernels import registry
from pdlab.kernels.contracts import ShapeError

sys.path.insert(0, str(Path(__file__).parent))
from flashinfer_fakes import CsrMetadata, attend  # noqa: E402


def _install(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def _outputs(q):
    B, Sq, H, _ = q.shape
    return torch.randn(B, Sq, H, 512).to(q.dtype), torch.randn(B, H, Sq)


# ------------------------------------------------------------------ flashmla


@pytest.mark.parametrize("generation", ["tensors", "scheduler-object"])
def test_flashmla_translation(monkeypatch, generation):
    p = decode_problem([70, 5, 128], heads=16, q_len=2, page=64, dtype=torch.bfloat16, poison=False)
    calls = {}

    class SchedMeta:  # the newer API's object, filled by the first call
        pass

    def get_mla_metadata(*args):
        calls["meta_args"] = args
        if generation == "tensors":
            return torch.zeros(8, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        return SchedMeta(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False):
        calls.update(q=q, k_cache=k_cache, block_table=block_table, seqlens=cache_seqlens, dv=head_dim_v,
                     meta=tile_scheduler_metadata, splits=num_splits, scale=softmax_scale, causal=causal)
        calls["ret"] = _outputs(q)
        return calls["ret"]

    _install(monkeypatch, "flash_mla", get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache)
    out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.125, backend=registry.get_backend(
        "mla_decode", "flashmla"))
    assert calls["meta_args"][0] is p.seqlens and calls["meta_args"][1:] == (2 * 16, 1)  # s_q*h_q/h_kv, h_kv
    assert calls["k_cache"].shape == (p.kv_cache.shape[0], 64, 1, 576)
    assert calls["k_cache"].data_ptr() == p.kv_cache.data_ptr()  # a view, no copy
    assert calls["q"] is p.q and calls["block_table"] is p.block_table and calls["seqlens"] is p.seqlens
    assert calls["dv"] == 512 and calls["scale"] == 0.125 and calls["causal"] is True
    if generation == "tensors":
        assert isinstance(calls["meta"], torch.Tensor) and isinstance(calls["splits"], torch.Tensor)
    else:
        assert isinstance(calls["meta"], SchedMeta) and calls["splits"] is None
    assert out is calls["ret"][0] and lse is calls["ret"][1]


def test_flashmla_rejects_what_it_cannot_run():
    b = registry.get_backend("mla_decode", "flashmla")
    p = decode_problem([10], heads=16, page=16, dtype=torch.bfloat16, poison=False)
    with pytest.raises(ShapeError, match=r"page size 16 not in \(64,\)"):
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.1, backend=b)
    p = decode_problem([10], heads=16, page=64, dtype=torch.bfloat16, kv_dtype="fp8", poison=False)
    with pytest.raises(ShapeError, match="kv cache dtype fp8"):
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.1, kv_scale=p.kv_scale, backend=b)


# ------------------------------------------------------------------ trtllm_mla


def _fake_trtllm(monkeypatch, with_lse):
    calls = []

    def impl(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
             seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0, **extra):
        calls.append(dict(query=query, kv_cache=kv_cache, workspace=workspace_buffer, dims=(qk_nope_head_dim,
                          kv_lora_rank, qk_rope_head_dim), block_tables=block_tables, seq_lens=seq_lens,
                          max_seq_len=max_seq_len, out=out, bmm1=bmm1_scale, bmm2=bmm2_scale, extra=extra))
        out.fill_(1.0)
        if extra.get("return_lse"):
            B, Sq, H, _ = query.shape
            return out, torch.arange(B * Sq * H, dtype=torch.float32).view(B, Sq, H)
        return out

    if with_lse:
        def fn(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
               seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0, return_lse=False):
            return impl(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                        block_tables, seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, return_lse=return_lse)
    else:
        def fn(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
               seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0):
            return impl(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                        block_tables, seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale)

    _install(monkeypatch, "flashinfer")
    _install(monkeypatch, "flashinfer.mla", trtllm_batch_decode_with_kv_cache_mla=fn)
    return calls


@pytest.mark.parametrize("kv_dtype,page,with_lse", [("bf16", 32, True), ("fp8", 64, False)])
def test_trtllm_translation(monkeypatch, kv_dtype, page, with_lse):
    from pdlab.attention.backends import trtllm_mla

    calls = _fake_trtllm(monkeypatch, with_lse)
    b = registry.get_backend("mla_decode", "trtllm_mla")
    p = decode_problem([5 * page - 3, 17], heads=16, q_len=2, page=page, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                       capacity=5 * page, poison=False)
    assert p.block_table.shape[1] == 5
    sm = 0.1
    for _ in range(2):
        out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, sm, kv_scale=p.kv_scale, backend=b)
    c = calls[-1]
    P = p.kv_cache.shape[0]
    assert c["kv_cache"].shape == (P, 1, page, 576) and c["kv_cache"].data_ptr() == p.kv_cache.data_ptr()
    assert c["dims"] == (128, 512, 64)
    ws = c["workspace"]
    assert ws.dtype == torch.uint8 and ws.numel() == 128 << 20 and not ws.any()
    assert calls[0]["workspace"] is ws and ws is trtllm_mla.workspace(p.q.device)  # kept per device
    multiple = 128 // page
    assert c["block_tables"].shape[1] % multiple == 0 and c["block_tables"].shape[1] >= 5
    assert torch.equal(c["block_tables"][:, :5], p.block_table) and not c["block_tables"][:, 5:].any()
    assert c["seq_lens"] is p.seqlens and c["max_seq_len"] == 5 * page
    if kv_dtype == "fp8":
        assert c["kv_cache"].dtype == torch.float8_e4m3fn and c["query"].dtype == torch.float8_e4m3fn
        assert math.isclose(c["bmm1"], p.kv_scale * sm) and math.isclose(c["bmm2"], p.kv_scale)
    else:
        assert c["kv_cache"].dtype == torch.bfloat16 and c["query"] is p.q
        assert c["bmm1"] == sm and c["bmm2"] == 1.0
    assert out.shape == (2, 2, 16, 512) and bool((out == 1).all())
    if with_lse:
        assert torch.equal(lse, torch.arange(2 * 2 * 16, dtype=torch.float32).view(2, 2, 16).transpose(1, 2))
    else:
        assert torch.isnan(lse).all()  # this flashinfer cannot return lse


def test_trtllm_tensor_scale_stays_on_device(monkeypatch):
    calls = _fake_trtllm(monkeypatch, False)
    p = decode_problem([40], heads=16, page=32, dtype=torch.bfloat16, kv_dtype="fp8", poison=False)
    scale = torch.tensor([p.kv_scale])
    mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.5, kv_scale=scale,
               backend=registry.get_backend("mla_decode", "trtllm_mla"))
    assert isinstance(calls[0]["bmm1"], torch.Tensor)
    torch.testing.assert_close(calls[0]["bmm1"], scale * 0.5)
    torch.testing.assert_close(calls[0]["bmm2"], scale)


# ------------------------------------------------------------------ flashinfer


def _fake_flashinfer(monkeypatch, api: str):
    """api: "keyword" (0.7 on: MLAPlanMetadata, keyword plan, packed run), "legacy_e" (flat plan, split run with
    return_lse_base_on_e), "legacy_log2" (flat plan, split run returning log2 LSE)."""
    log = {"plans": [], "runs": [], "init": []}

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, workspace, backend="auto"):
            log["init"].append((workspace, backend))

        if api == "keyword":
            def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                     q_data_type, kv_data_type, query_layout="packed", kv_cache_layout="packed", lse_mode="none",
                     scale_mode="default"):
                log["plans"].append((*metadata.t, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                                     q_data_type, kv_data_type))
                log["layouts"] = (query_layout, kv_cache_layout, lse_mode, scale_mode)

            def run(self, *, query, kv_cache, return_lse=False, return_lse_base_on_e=False, ckv_scale=None,
                    kpe_scale=None):
                log["runs"].append(dict(query=query, kv_cache=kv_cache, lse=return_lse, e=return_lse_base_on_e,
                                        scales=(ckv_scale, kpe_scale)))
                return torch.zeros(*query.shape[:2], 512, dtype=query.dtype), torch.ones(query.shape[:2])
        else:
            def plan(self, *args):
                log["plans"].append(args)

        if api == "legacy_e":
            def run(self, q_nope, q_pe, ckv, kpe, return_lse=False, return_lse_base_on_e=False):
                log["runs"].append(dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, lse=return_lse, e=return_lse_base_on_e))
                return torch.zeros(q_nope.shape, dtype=q_nope.dtype), torch.ones(q_nope.shape[:2])
        elif api == "legacy_log2":
            def run(self, q_nope, q_pe, ckv, kpe, return_lse=False):
                log["runs"].append(dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, lse=return_lse))
                return torch.zeros(q_nope.shape, dtype=q_nope.dtype), torch.ones(q_nope.shape[:2])

    _install(monkeypatch, "flashinfer")
    extra = {"MLAPlanMetadata": CsrMetadata} if api == "keyword" else {}
    _install(monkeypatch, "flashinfer.mla", BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper, **extra)
    return log


@pytest.mark.parametrize("api", ["keyword", "legacy_e", "legacy_log2"])
def test_flashinfer_decode_plans_once_per_step(monkeypatch, api):
    from pdlab.attention.backends import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "_WRAPPERS", {})
    log = _fake_flashinfer(monkeypatch, api)
    b = registry.get_backend("mla_decode", "flashinfer")
    p = decode_problem([9, 30], heads=16, q_len=2, page=16, dtype=torch.bfloat16, poison=False)
    for _layer in range(3):
        out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, backend=b)
    assert len(log["plans"]) == 1 and len(log["runs"]) == 3 and len(log["init"]) == 1
    assert log["init"][0][1] == "fa2" and log["init"][0][0].numel() == 128 << 20
    qo, kv_indptr, kv_indices, kv_len, H, dckv, dkpe, page, causal, scale, qd, kd = log["plans"][0]
    # each sequence lists exactly its ceil(len / page) pages: 9 tokens -> 1 page, 30 -> 2 (flashinfer 0.7 rejects
    # any other count)
    assert qo.tolist() == [0, 2, 4] and kv_indptr.tolist() == [0, 1, 3] and kv_len is p.seqlens
    assert kv_indices.tolist() == [p.block_table[0, 0].item(), *p.block_table[1, :2].tolist()]
    assert (H, dckv, dkpe, page, causal, scale, qd, kd) == (16, 512, 64, 16, True, 0.2, torch.bfloat16, torch.bfloat16)
    r = log["runs"][0]
    assert r["lse"] is True
    if api == "keyword":  # packed tensors, zero-copy: the query rows are the caller's, the cache is the pool itself
        assert log["layouts"] == ("packed", "packed", "basee", "default") and r["e"] is True
        assert r["scales"] == (None, None)
        assert r["query"].shape == (4, 16, 576) and r["query"].data_ptr() == p.q.data_ptr()
        assert r["kv_cache"] is p.kv_cache
    else:
        assert r["q_nope"].shape == (4, 16, 512) and r["q_pe"].shape == (4, 16, 64)
        assert r["ckv"].shape == (p.kv_cache.shape[0], 16, 512)
        assert r["kpe"].data_ptr() == p.kv_cache[..., 512:].data_ptr()
    expected = math.log(2.0) if api == "legacy_log2" else 1.0  # log2 LSE converted to natural log
    assert torch.allclose(lse, torch.full((2, 16, 2), expected)) and out.shape == (2, 2, 16, 512)
    if api == "legacy_e":
        assert r["e"] is True
    # next step: the engine updates seqlens in place -> one new plan, then reuse again
    p.seqlens.add_(1)
    mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, backend=b)
    mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, backend=b)
    assert len(log["plans"]) == 2 and len(log["init"]) == 1


@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_flashinfer_fp8_pool_is_read_as_e4m3_with_the_per_tensor_scale(monkeypatch, scale_kind):
    """An fp8 pool (uint8 e4m3 bytes + kv_scale) goes to flashinfer as a float8_e4m3fn view of the same memory,
    planned in the kv-per-tensor scale mode, with kv_scale as both ckv_scale and kpe_scale; a kv_scale tensor is read
    on the host once per version (so a graph captured after the eager calls never syncs)."""
    from pdlab.attention.backends import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "_WRAPPERS", {})
    monkeypatch.setattr(registry, "detect_arch", lambda device=None: "sm90")  # the fp8 cache is offered on sm90
    log = _fake_flashinfer(monkeypatch, "keyword")
    b = registry.get_backend("mla_decode", "flashinfer")
    p = decode_problem([9, 30], heads=16, q_len=1, page=16, dtype=torch.bfloat16, kv_dtype="fp8", poison=False)
    assert p.kv_cache.dtype == torch.uint8
    kv_scale = torch.tensor([0.375]) if scale_kind == "tensor" else 0.375
    for _layer in range(2):
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, kv_scale=kv_scale, backend=b)
    plan = log["plans"][0]
    assert len(log["plans"]) == 1 and plan[-1] == torch.float8_e4m3fn and plan[-2] == torch.bfloat16
    assert log["layouts"][3] == "kv-per-tensor"
    for r in log["runs"]:
        assert r["kv_cache"].dtype == torch.float8_e4m3fn and r["kv_cache"].data_ptr() == p.kv_cache.data_ptr()
        assert r["scales"] == (0.375, 0.375)
    if scale_kind == "tensor":  # a new value in place: read again
        kv_scale.fill_(0.5)
        mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.2, kv_scale=kv_scale, backend=b)
        assert log["runs"][-1]["scales"] == (0.5, 0.5)
    # fp16 queries cannot read an fp8 cache in flashinfer: a clear error, not a vendor traceback
    with pytest.raises(ValueError, match="bf16 queries only"):
        mla_decode(p.q.half(), p.kv_cache, p.block_table, p.seqlens, 0.2, kv_scale=kv_scale, backend=b)


def test_flashinfer_is_not_chosen_unmeasured_for_an_fp8_pool(monkeypatch):
    """Without a tuned entry, an fp8 pool goes to a backend preferred for fp8 (pdlab's kernels were 1.7-5.3x faster
    than flashinfer's fp8 path on H200), a bf16 pool to flashinfer by preference; named, flashinfer reads fp8."""
    from pdlab.attention import ops

    monkeypatch.setattr(registry, "detect_arch", lambda device=None: "sm90")
    monkeypatch.setitem(registry._PROBE_CACHE, ("mla_decode", "flashinfer", "sm90"), None)
    monkeypatch.setitem(registry._PROBE_CACHE, ("mla_decode", "triton", "sm90"), None)
    monkeypatch.setattr(ops, "_SELECTED", {})
    monkeypatch.setattr(ops, "_tuned_backend", lambda *a: None)
    bf16 = decode_problem([9, 30], heads=16, q_len=1, page=16, dtype=torch.bfloat16, poison=False)
    fp8 = decode_problem([9, 30], heads=16, q_len=1, page=16, dtype=torch.bfloat16, kv_dtype="fp8", poison=False)
    assert ops._select(ops.MLA_DECODE, None, bf16.q, bf16.kv_cache, q_len=1, bucket={"b": 1}).name == "flashinfer"
    assert ops._select(ops.MLA_DECODE, None, fp8.q, fp8.kv_cache, q_len=1, bucket={"b": 1}).name == "triton"
    flash = registry.get_backend("mla_decode", "flashinfer")
    assert ops._select(ops.MLA_DECODE, flash, fp8.q, fp8.kv_cache, q_len=1).name == "flashinfer"


def test_flashinfer_fp8_cache_is_offered_on_sm90_only():
    from pdlab.attention.ops import supports

    b = registry.get_backend("mla_decode", "flashinfer")
    kw = dict(page_size=64, q_dtype="bf16", q_len=1)
    assert supports(b, kv_dtype="fp8", arch="sm90", **kw) is None
    assert "sm90 only, not sm100" in supports(b, kv_dtype="fp8", arch="sm100", **kw)
    assert supports(b, kv_dtype="bf16", arch="sm100", **kw) is None


@pytest.mark.parametrize("api", ["keyword", "legacy_e"])
def test_flashinfer_prefill_plan_is_causal_and_ragged(monkeypatch, api):
    from pdlab.attention.backends import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "_WRAPPERS", {})
    log = _fake_flashinfer(monkeypatch, api)
    p = prefill_problem([20, 7], [5, 7], heads=4, page=8, dtype=torch.bfloat16, poison=False)
    out, lse = mla_prefill(p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, 0.3,
                           backend=registry.get_backend("mla_prefill", "flashinfer"))
    args = log["plans"][0]
    assert args[0] is p.qo_indptr and args[8] is True and out.shape == (12, 4, 512) and lse.shape == (12, 4)


def _attending_fake_flashinfer(monkeypatch, capacity_rows: int):
    """A keyword-API flashinfer whose run computes MLA in fp32 from exactly what was planned (qo_indptr, the CSR
    pages, kv_len, causality) and whose plan refuses a batch of more than `capacity_rows` query rows, as the real
    scheduler refuses more work items than it has."""
    plans = []

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, workspace, backend="auto"):
            pass

        def plan(self, *, metadata, causal, sm_scale, page_size, **kw):
            qo = metadata.t[0].tolist()
            if qo[-1] > capacity_rows:
                raise ValueError(f"FA MLA needs at least {qo[-1]} work items; native capacity is {capacity_rows}.")
            plans.append(qo[-1])
            self.meta = [t.tolist() for t in metadata.t] + [causal, sm_scale, page_size]

        def run(self, *, query, kv_cache, return_lse, return_lse_base_on_e):
            qo, kv_indptr, kv_indices, kv_len, causal, scale, page = self.meta
            return attend(query, kv_cache, qo, kv_indptr, kv_indices, kv_len, causal, scale)

    _install(monkeypatch, "flashinfer")
    _install(monkeypatch, "flashinfer.mla", BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper,
             MLAPlanMetadata=CsrMetadata)
    return plans


@pytest.mark.parametrize("capacity", [1000, 40, 7])
def test_flashinfer_prefill_over_capacity_runs_in_parts_with_the_same_result(monkeypatch, capacity):
    """A batch over the scheduler's capacity is split by query rows, also inside a sequence (a part attends to the
    cache up to its own last row): the result equals the torch reference on the whole batch, and every plan
    fits the capacity."""
    from pdlab.attention.backends import flashinfer_mla

    monkeypatch.setattr(flashinfer_mla, "_WRAPPERS", {})
    plans = _attending_fake_flashinfer(monkeypatch, capacity)
    p = prefill_problem([40, 9, 33, 70], [25, 9, 0, 30], heads=2, page=8, dtype=torch.float16, seed=3)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, 0.05)
    ref_out, ref_lse = mla_prefill(*args, backend="torch")
    out, lse = mla_prefill(*args, backend=registry.get_backend("mla_prefill", "flashinfer"))
    assert (out.float() - ref_out.float()).abs().max() < 2e-3 and (lse - ref_lse.float()).abs().max() < 1e-4
    assert plans and max(plans) <= capacity and sum(plans) == 64
    assert len(plans) == (1 if capacity >= 64 else 2 if capacity >= 32 else 16)


def test_adapters_are_listed_unavailable_with_reasons():
    rows = {(r["op"], r["backend"]): r for r in registry.matrix()}
    for key in [("mla_decode", "flashmla"), ("mla_decode", "trtllm_mla"), ("mla_decode", "flashinfer")]:
        assert key in rows
        if not rows[key]["available"]:
            assert rows[key]["reason"]
    assert rows[("mla_decode", "torch")]["available"] and rows[("mla_decode", "torch")]["reference"]
    assert "return_lse" not in inspect.signature(mla_decode).parameters  # the agreed API, unchanged
