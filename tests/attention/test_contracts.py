"""Contract violations raise ShapeError naming the argument, with a hint; host-known values are
checked without a device sync; selection honours page size, kv dtype and S_q."""

import pytest
import torch

import pdlab.attention as attention
from pdlab.attention import mla_decode, mla_prefill, store_kv
from pdlab.attention.ops import resolve_config
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.kernels import registry
from pdlab.kernels.contracts import ShapeError


@pytest.fixture
def prob():
    return decode_problem([10, 30], heads=4, q_len=1, page=16, dtype=torch.float32, poison=False, seed=1)


def _call(p, **over):
    args = dict(q=p.q, kv_cache=p.kv_cache, block_table=p.block_table, seqlens=p.seqlens, softmax_scale=0.1)
    args.update(over)
    kw = {k: args.pop(k) for k in list(args) if k not in ("q", "kv_cache", "block_table", "seqlens", "softmax_scale")}
    return mla_decode(args["q"], args["kv_cache"], args["block_table"], args["seqlens"], args["softmax_scale"], **kw)


def test_exports():
    for name in ("mla_decode", "mla_prefill", "store_kv", "quantize_kv_fp8", "dequantize_kv_fp8"):
        assert callable(getattr(attention, name))


def test_head_dim_not_576(prob):
    with pytest.raises(ShapeError, match=r"'q'.*576.*absorb") as e:
        _call(prob, q=prob.q[..., :512].contiguous())
    assert e.value.argument == "q" and "W_UK" in e.value.hint
    with pytest.raises(ShapeError, match="'kv_cache'"):
        _call(prob, kv_cache=prob.kv_cache[..., :512])


def test_non_int32_tables(prob):
    with pytest.raises(ShapeError, match=r"'block_table' has the wrong dtype.*to\(torch.int32\)"):
        _call(prob, block_table=prob.block_table.long())
    with pytest.raises(ShapeError, match=r"'seqlens' has the wrong dtype"):
        _call(prob, seqlens=prob.seqlens.long())


def test_batch_mismatch_and_page_size(prob):
    with pytest.raises(ShapeError, match=r"'block_table'.*B=2"):
        _call(prob, block_table=prob.block_table[:1])
    kv = torch.zeros(6, 3, 576)  # page size 3
    with pytest.raises(ShapeError, match="page size 3.*power of two"):
        _call(prob, kv_cache=kv)


def test_seqlen_beyond_pages(prob):
    cap = prob.block_table.shape[1] * 16
    with pytest.raises(ShapeError, match=f"reaches {cap + 1} tokens, beyond the pages given") as e:
        _call(prob, seqlens=torch.tensor([5, cap + 1], dtype=torch.int32))
    assert "widen block_table" in str(e.value)
    with pytest.raises(ShapeError, match="beyond the pages given"):
        _call(prob, max_seqlen=cap + 1)  # device tensors: the caller's host bound is checked instead
    top = int(prob.seqlens.max())
    with pytest.raises(ShapeError, match=f"reaches {top} tokens, beyond max_seqlen={top - 1}"):
        _call(prob, max_seqlen=top - 1)  # host seqlens: a bound they break is named, not trusted
    _call(prob, max_seqlen=top)
    with pytest.raises(ShapeError, match="fewer than its 1 new"):
        _call(prob, seqlens=torch.tensor([0, 4], dtype=torch.int32))


def test_fp8_scale_rules(prob):
    p = decode_problem([10], heads=4, page=16, dtype=torch.float32, kv_dtype="fp8", poison=False, seed=2)
    with pytest.raises(ShapeError, match="kv_scale.*missing"):
        _call(p)
    with pytest.raises(ShapeError, match="non-fp8 pool"):
        _call(prob, kv_scale=1.0)
    out, _ = _call(p, kv_scale=p.kv_scale)  # float8_e4m3fn pools are accepted as the same bytes
    out2, _ = _call(p, kv_cache=p.kv_cache.view(torch.float8_e4m3fn), kv_scale=p.kv_scale)
    assert torch.equal(out, out2)


def test_prefill_contract():
    p = prefill_problem([10, 6], [4, 6], heads=2, page=4, dtype=torch.float32, poison=False, seed=3)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens)
    with pytest.raises(ShapeError, match="'qo_indptr' has the wrong length"):
        mla_prefill(*args, p.qo_indptr[:2], 0.1)
    with pytest.raises(ShapeError, match="'qo_indptr' is not a valid indptr"):
        mla_prefill(*args, torch.tensor([0, 4, 9], dtype=torch.int32), 0.1)
    with pytest.raises(ShapeError, match="smaller than the new tokens"):
        mla_prefill(p.q, p.kv_cache, p.block_table, torch.tensor([3, 6], dtype=torch.int32), p.qo_indptr, 0.1)
    with pytest.raises(ShapeError, match="max_q_len"):
        mla_prefill(*args, p.qo_indptr, 0.1, max_q_len=100)


def test_store_contract():
    kv = torch.zeros(2, 4, 576)
    with pytest.raises(ShapeError, match=r"'slots' has the wrong dtype.*int64"):
        store_kv(kv, torch.tensor([0], dtype=torch.int32), torch.zeros(1, 576))
    with pytest.raises(ShapeError, match="'latent'"):
        store_kv(kv, torch.tensor([0, 1]), torch.zeros(3, 576))


def test_selection_and_config(prob):
    # on this machine the default is the best usable backend that accepts the inputs
    b = registry.select("mla_decode", device=prob.q.device,
                        accept=lambda b: b.options.get("page_sizes") is None or 16 in b.options["page_sizes"])
    out, _ = _call(prob)
    ref, _ = _call(prob, backend=b.name)
    assert torch.equal(out, ref)
    tri = registry.get_backend("mla_decode", "triton")
    cfg, src = resolve_config("mla_decode", tri, {"batch": 2, "seqlen": 64, "heads": 4, "q_len": 1}, None,
                              {"BLOCK_N": 16})
    assert src == "explicit" and cfg["BLOCK_N"] == 16 and cfg["BLOCK_H"] == tri.default_config["BLOCK_H"]
    with pytest.raises(ValueError, match="unknown config keys"):
        resolve_config("mla_decode", tri, {"batch": 2}, None, {"BLOCK_Q": 16})
    with pytest.raises(ShapeError, match=r"S_q=16 not in"):
        q = torch.zeros(2, 16, 4, 576)
        mla_decode(q, prob.kv_cache, prob.block_table, torch.tensor([20, 30], dtype=torch.int32), 0.1, backend=tri)


def test_tuned_file_drives_config_and_backend(tmp_path, monkeypatch):
    # a tuned store for this machine (device "cpu") naming the triton config and the winning backend
    import json

    from pdlab.attention import ops
    from pdlab.kernels import tuned

    bucket = {"batch": 2, "heads": 4, "kv_dtype": "fp32", "q_len": 1, "seqlen": 32}
    entry = {"bucket": bucket, "backend": "torch",
             "backends": {"triton": {"config": {"BLOCK_N": 16, "num_stages": 1}, "time_ms": 1.0}}}
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "mla_decode.json").write_text(json.dumps(
        {"format": tuned.FORMAT_VERSION, "metadata": {"device": "cpu", "versions": {}},
         "entries": {tuned.bucket_label(bucket): entry}}))
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(tmp_path))
    tuned.clear_cache()
    ops.clear_config_cache()
    try:
        tri = registry.get_backend("mla_decode", "triton")
        cfg, src = resolve_config("mla_decode", tri, bucket, torch.device("cpu"))
        assert src.startswith("tuned:") and cfg["BLOCK_N"] == 16 and cfg["num_stages"] == 1
        assert cfg["BLOCK_H"] == tri.default_config["BLOCK_H"]
        # an explicit empty config overrides nothing of the default: the default, not the tuned entry
        cfg, src = resolve_config("mla_decode", tri, bucket, torch.device("cpu"), {})
        assert src == "explicit" and cfg == tri.config()
        assert ops._tuned_backend("mla_decode", bucket, torch.device("cpu")) == "torch"
        p = decode_problem([10, 30], heads=4, page=16, dtype=torch.float32, poison=False, seed=4)
        out, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, 0.1)  # tuned winner, usable here
        assert out.shape == (2, 1, 4, 512)
    finally:
        tuned.clear_cache()
        ops.clear_config_cache()


@pytest.mark.parametrize("scale", [None, float("nan"), float("inf"), 0.0, -0.1, torch.tensor(float("nan")),
                                   torch.tensor([0.1, 0.2]), "scale"])
def test_softmax_scale_that_is_no_positive_number_is_named(prob, scale):
    # None gave a bare TypeError from float(); NaN or inf gave NaN outputs, 0 or below a meaningless softmax, silently
    with pytest.raises(ShapeError, match=r"mla_decode argument 'softmax_scale' is .*finite number > 0") as e:
        _call(prob, softmax_scale=scale)
    assert e.value.argument == "softmax_scale" and "1/sqrt(192)" in e.value.hint
    p = prefill_problem([20, 9], [5, 9], 4, 16, torch.float32, seed=2)
    with pytest.raises(ShapeError, match=r"mla_prefill argument 'softmax_scale'"):
        mla_prefill(p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, scale)


@pytest.mark.parametrize("scale", [0.1, 1, torch.tensor(0.1), torch.tensor([0.1])])
def test_softmax_scale_as_number_or_one_element_tensor_still_runs(prob, scale):
    out, lse = _call(prob, softmax_scale=scale)
    ref_out, ref_lse = _call(prob, softmax_scale=float(scale))
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_a_query_on_another_device_is_named_not_blamed_on_the_rest(prob):
    # q on another device than every other tensor said "'kv_cache' is on cpu while the other tensors are on meta"
    with pytest.raises(ShapeError, match=r"'kv_cache' is on cpu while 'q' is on meta"):
        _call(prob, q=prob.q.to("meta"))
    with pytest.raises(ShapeError, match=r"'seqlens' is on meta while the other tensors are on cpu"):
        _call(prob, seqlens=prob.seqlens.to("meta"))
