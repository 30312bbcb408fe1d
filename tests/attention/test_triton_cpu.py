"""pdlab's Triton MLA kernels against the torch fp32 reference, under the Triton interpreter on CPU
(fp16/fp32; bf16 dots and fp8 rounding are checked on the GPU). Every problem poisons the rows
past each sequence's length with NaN, so a kernel that reads them fails."""

import pytest
import torch

from pdlab.attention import mla_decode, mla_prefill, store_kv
from pdlab.attention.kv import dequantize_kv_fp8, quantize_kv_fp8
from pdlab.attention.workloads import decode_problem, prefill_problem
from pdlab.bench.harness import cosine_error
from pdlab.kernels import registry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests; GPU runs test_gpu.py")

TRITON_DECODE = registry.get_backend("mla_decode", "triton")
TRITON_PREFILL = registry.get_backend("mla_prefill", "triton")
TRITON_STORE = registry.get_backend("store_kv", "triton")


def _close(out, lse, ref_out, ref_lse, tol):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN: a row past a seqlen was read"
    assert cosine_error(out, ref_out) < tol, cosine_error(out, ref_out)
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4), (lse - ref_lse).abs().max()
    assert torch.allclose(out.float(), ref_out.float(), atol=5e-3 if out.dtype == torch.float16 else 1e-4)


def _decode(p, backend, **kw):
    return mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                      backend=backend, **kw)


# ragged lengths: 1 token past S_q, page boundaries (page, page+1, 2*page - 1), longer ones
def _lengths(page: int, q_len: int) -> list[int]:
    return sorted({max(q_len, 1 + q_len - 1), page, page + 1, 2 * page - 1, 3 * page + 5, q_len})


@pytest.mark.parametrize("page,q_len,dtype", [(1, 1, torch.float32), (2, 4, torch.float16), (16, 2, torch.float32),
                                              (16, 4, torch.float16), (64, 1, torch.float16),
                                              (128, 2, torch.float32)])
def test_decode_matches_reference(page, q_len, dtype, seed):
    lens = [n for n in _lengths(min(page, 24), q_len) if n >= q_len]
    p = decode_problem(lens, heads=4, q_len=q_len, page=page, dtype=dtype, seed=seed)
    assert torch.isnan(p.kv_cache).any(), "the poison must be there for this test to mean anything"
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2})
    assert out.shape == (len(lens), q_len, 4, 512) and out.dtype == dtype and lse.shape == (len(lens), 4, q_len)
    _close(out, lse, ref_out, ref_lse, 1e-5)


@pytest.mark.parametrize("splits", [1, 3, 0])
def test_decode_splits_agree(splits, seed):
    p = decode_problem([1, 40, 77], heads=16, q_len=1, page=16, dtype=torch.float32, seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "BLOCK_H": 16, "num_splits": splits})
    _close(out, lse, ref_out, ref_lse, 1e-6)


def test_decode_many_heads_per_program(seed):
    # 32 heads in programs of 16: two head blocks share each sequence's pages
    p = decode_problem([9, 33], heads=32, q_len=2, page=8, dtype=torch.float16, seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "BLOCK_H": 16, "num_splits": 2})
    _close(out, lse, ref_out, ref_lse, 1e-5)


def test_decode_fp8_matches_dequantised_reference(seed):
    p = decode_problem([3, 17, 50], heads=4, q_len=2, page=16, dtype=torch.float16, kv_dtype="fp8", seed=seed)
    assert p.kv_cache.dtype == torch.uint8
    ref_out, ref_lse = _decode(p, "torch")  # the reference dequantises the same bytes in fp32
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2})
    _close(out, lse, ref_out, ref_lse, 1e-5)
    # a tensor scale (graph-safe form) gives the same result
    out2, lse2 = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale,
                            kv_scale=torch.tensor([p.kv_scale]), backend=TRITON_DECODE,
                            config={"BLOCK_N": 16, "num_splits": 2})
    # (the interpreter does scalar arithmetic of float arguments in fp64: allow fp16 rounding noise)
    torch.testing.assert_close(out2, out, atol=1e-3, rtol=1e-3)
    # and the scale really is applied: a wrong one changes the answer
    out3, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale * 2,
                         backend=TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2})
    assert cosine_error(out3, ref_out) > 1e-4


@pytest.mark.parametrize("page,block_t,splits", [(16, 4, 1), (1, 2, 2), (64, 1, 1)])
def test_prefill_ragged_matches_reference(page, block_t, splits, seed):
    seqlens, new = [5, 40, 37, 1, 20], [5, 3, 37, 1, 0]  # full prefill, extend, single token, idle sequence
    p = prefill_problem(seqlens, new, heads=4, page=page, dtype=torch.float16, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref_out, ref_lse = mla_prefill(*args, backend="torch")
    out, lse = mla_prefill(*args, backend=TRITON_PREFILL, max_q_len=p.max_q_len,
                           config={"BLOCK_N": 16, "BLOCK_H": 16, "BLOCK_T": block_t, "num_splits": splits})
    assert out.shape == (sum(new), 4, 512) and lse.shape == (sum(new), 4)
    _close(out, lse, ref_out, ref_lse, 1e-5)


@pytest.mark.parametrize("dequant", [0, 1])
@pytest.mark.parametrize("scale_tensor", [False, True])
def test_prefill_without_max_q_len_and_fp8(dequant, scale_tensor, seed):
    # an fp8 pool read in the kernel (fp8_dequant 0) or dequantised once into a pool of q's dtype first (1); the
    # scale as a host number or as a device tensor (graph-safe)
    p = prefill_problem([30, 9], [12, 9], heads=2, page=4, dtype=torch.float32, kv_dtype="fp8", seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    scale = torch.tensor(p.kv_scale) if scale_tensor else p.kv_scale
    ref_out, ref_lse = mla_prefill(*args, kv_scale=p.kv_scale, backend="torch")
    out, lse = mla_prefill(*args, kv_scale=scale, backend=TRITON_PREFILL,
                           config={"BLOCK_N": 16, "fp8_dequant": dequant})
    _close(out, lse, ref_out, ref_lse, 1e-6)


def test_dequantize_pages_is_the_pools_dequantisation_page_by_page(seed):
    # entry (b, w) of the new table names page b·W + w of the new pool, holding e4m3 · scale of the page the old
    # table named, exactly; ids outside the pool (-1, P) read page 0 instead of faulting
    from pdlab.attention import triton_kernels as tk
    from pdlab.attention.kv import dequantize_kv_fp8

    p = prefill_problem([30, 9], [12, 9], heads=2, page=4, dtype=torch.float32, kv_dtype="fp8", seed=seed)
    table = p.block_table.clone()
    table[1, -1], table[1, -2] = -1, p.kv_cache.shape[0]
    for dtype in (torch.float32, torch.bfloat16):
        pool, new = tk.dequantize_pages(p.kv_cache, table, p.kv_scale, dtype)
        B, W = table.shape
        assert pool.shape == (B * W, 4, 576) and pool.dtype == dtype
        assert torch.equal(new, torch.arange(B * W, dtype=torch.int32).view(B, W))
        want = dequantize_kv_fp8(p.kv_cache[table.clamp(0).where(table < p.kv_cache.shape[0], 0).flatten().long()],
                                 p.kv_scale).to(dtype)
        known = ~want.isnan()  # the poisoned rows past each length hold e4m3 NaN bytes (the interpreter reads 480)
        assert known.float().mean() > 0.5
        # fp32 exactly; bf16 within one rounding (the interpreter truncates where the GPU rounds to nearest)
        torch.testing.assert_close(pool[known].float(), want[known].float(), atol=0,
                                   rtol=0 if dtype == torch.float32 else 2 ** -7)


def test_prefill_fp8_dequant_auto_rule(monkeypatch, seed):
    # "auto" dequantises for bf16/fp32 queries while the copy holds at most PREFILL_DEQUANT_MAX_TOKENS tokens; fp16
    # queries never (e4m3 · scale may pass fp16's range), not even when asked; both paths match the reference
    from pdlab.attention import triton_kernels as tk
    from pdlab.attention.backends import triton_mla
    from pdlab.attention.backends.triton_mla import _dequant_first

    table = torch.zeros(4, 16, dtype=torch.int32)  # 4 sequences × 16 pages of 64: 4096 tokens
    cap = triton_mla.PREFILL_DEQUANT_MAX_TOKENS
    assert _dequant_first({"fp8_dequant": "auto"}, torch.bfloat16, table, 64)
    assert _dequant_first({}, torch.float32, table, 64)  # a config from before the knob: auto
    assert not _dequant_first({"fp8_dequant": "auto"}, torch.bfloat16, torch.zeros(1, cap // 64 + 1), 64)
    assert _dequant_first({"fp8_dequant": 1}, torch.bfloat16, torch.zeros(1, cap // 64 + 1), 64)  # asked
    assert not _dequant_first({"fp8_dequant": 0}, torch.bfloat16, table, 64)
    assert not _dequant_first({"fp8_dequant": "auto"}, torch.float16, table, 64)
    assert not _dequant_first({"fp8_dequant": 1}, torch.float16, table, 64)

    calls = []
    real = tk.dequantize_pages
    monkeypatch.setattr(tk, "dequantize_pages", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    p = prefill_problem([30, 9], [12, 9], heads=2, page=4, dtype=torch.float32, kv_dtype="fp8", seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref_out, ref_lse = mla_prefill(*args, kv_scale=p.kv_scale, backend="torch")
    for limit, want in [(1 << 18, 1), (8, 0)]:
        monkeypatch.setattr(triton_mla, "PREFILL_DEQUANT_MAX_TOKENS", limit)
        calls.clear()
        out, lse = mla_prefill(*args, kv_scale=p.kv_scale, backend=TRITON_PREFILL)  # the default config
        assert len(calls) == want and (not want or calls[0] == p.block_table.shape)
        _close(out, lse, ref_out, ref_lse, 1e-6)


def test_decode_equals_prefill_of_the_same_tokens(seed):
    # decode with S_q = 4 is the extend of 4 tokens per sequence: both kernels' paths must agree
    p = decode_problem([4, 21, 30], heads=4, q_len=4, page=8, dtype=torch.float32, seed=seed)
    out_d, lse_d = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2})
    indptr = torch.arange(4, dtype=torch.int32) * 4
    out_p, lse_p = mla_prefill(p.q.reshape(12, 4, 576), p.kv_cache, p.block_table, p.seqlens, indptr, p.softmax_scale,
                               backend=TRITON_PREFILL, config={"BLOCK_N": 16, "BLOCK_T": 2})
    torch.testing.assert_close(out_p.view(3, 4, 4, 512), out_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_p.view(3, 4, 4).transpose(1, 2), lse_d, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_kv_matches_reference(dtype, seed):
    P, page = 6, 4
    latent = torch.randn(7, 576, dtype=dtype)
    slots = torch.tensor([0, 5, -1, 23, 9, -1, 2], dtype=torch.int64)
    a = torch.full((P, page, 576), 7.0, dtype=dtype)
    b = a.clone()
    store_kv(a, slots, latent, backend="torch")
    store_kv(b, slots, latent, backend=TRITON_STORE)
    assert torch.equal(a, b)
    assert torch.equal(a[5 // page, 5 % page], latent[1]) and torch.equal(a[0, 3], torch.full((576,), 7.0, dtype=dtype))
    # out-of-pool slots: skipped by the kernel (no sync to raise), an error in the reference
    c = a.clone()
    store_kv(c, torch.tensor([24, -1], dtype=torch.int64), latent[:2], backend=TRITON_STORE)
    assert torch.equal(c, a)
    with pytest.raises(ValueError, match="beyond the pool"):
        store_kv(c, torch.tensor([24], dtype=torch.int64), latent[:1], backend="torch")


def test_store_kv_fp8(seed):
    # The interpreter's fp32 -> e4m3 rounding is wrong at binade edges (127.7 -> 64), so on CPU the
    # kernel's addressing, scaling and saturation are checked with values that need no rounding:
    # e4m3-representable values times a power-of-two scale. Rounding itself is checked on the GPU.
    P, page, scale = 4, 8, 0.5
    codes = torch.randint(0, 256, (10, 576), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    latent = dequantize_kv_fp8(codes, scale).to(torch.float16)
    latent[0, :3] = torch.tensor([1e4, -1e4, 0.0])  # saturates to +-448
    slots = torch.randperm(P * page)[:10].to(torch.int64)
    slots[4] = -1
    a = torch.zeros(P, page, 576, dtype=torch.uint8)
    b = a.clone()
    store_kv(a, slots, latent, kv_scale=scale, backend="torch")
    store_kv(b, slots, latent, kv_scale=torch.tensor(scale), backend=TRITON_STORE)
    assert torch.equal(a, b)
    rows = dequantize_kv_fp8(a.view(-1, 576)[slots[slots >= 0]], scale)
    assert rows[0, :3].tolist() == [448 * scale, -448 * scale, 0.0]
    keep = torch.arange(10) != 4
    torch.testing.assert_close(rows[1:], latent[keep][1:].float(), rtol=0, atol=0)
    assert torch.equal(quantize_kv_fp8(latent[keep], scale), a.view(-1, 576)[slots[keep]])
    assert not a.view(-1, 576)[~torch.isin(torch.arange(P * page), slots)].any()  # nothing else written


@pytest.mark.parametrize("knobs", [{}, {"d_quarters": 1, "q_prescale": 1}])
def test_fp8_fp16_compute_survives_q_beyond_fp16_range(knobs, seed):
    # rows of q far above fp16's 65504 (and one tiny row): the per-row power-of-two scaling keeps the
    # fp16 dots finite and exact up to rounding; a plain cast would give inf/NaN. q_prescale: the scaling
    # done by its own kernel before the launch, the factors read back per row
    p = decode_problem([9, 40], heads=16, q_len=1, page=16, dtype=torch.bfloat16, kv_dtype="fp8", seed=seed)
    p.q[0, 0, :4] *= 3e5
    p.q[1, 0, 5] *= 1e-4
    p.softmax_scale = 1e-6  # keep the softmax of the huge rows from collapsing to one-hot
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2, "fp8_compute": "fp16", **knobs})
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # bf16 outputs on both sides: over 40 seeds the error is 8e-6 median, 1.1e-5 max (whole tile or column
    # quarters alike), so the 1e-5 this test had failed 3 seeds in 40; a broken rescale errs by O(1) or NaN
    assert cosine_error(out, ref_out) < 3e-5 and torch.allclose(lse, ref_lse, atol=1e-2)


def test_fp8_fp16_compute_path(seed):
    # fp8_compute="fp16": q (here bf16) and the e4m3 rows go to fp16 for the dots
    p = decode_problem([7, 33], heads=16, q_len=1, page=16, dtype=torch.bfloat16, kv_dtype="fp8", seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "num_splits": 2, "fp8_compute": "fp16"})
    assert out.dtype == torch.bfloat16
    assert cosine_error(out, ref_out) < 1e-5 and torch.allclose(lse, ref_lse, atol=1e-2)



@pytest.mark.parametrize("page,q_len,heads,kv,cfg", [
    (16, 1, 16, "same", {"BLOCK_N": 16, "num_splits": 2}),
    (1, 4, 4, "same", {"BLOCK_N": 16, "num_splits": 3}),
    (64, 2, 32, "same", {"BLOCK_N": 32, "BLOCK_H": 16, "num_splits": 1}),
    (16, 1, 16, "fp8", {"BLOCK_N": 16, "num_splits": 2, "fp8_reload": 1}),
    (8, 2, 4, "fp8", {"BLOCK_N": 16, "num_splits": 0, "fp8_reload": 0}),
])
def test_token_major_kernel_matches_reference(page, q_len, heads, kv, cfg, seed):
    # swap_ab=1: the token-major kernel (K·q^T, V^T·p^T) must give the row-major kernel's results
    lens = [n for n in _lengths(min(page, 24), q_len) if n >= q_len]
    p = decode_problem(lens, heads=heads, q_len=q_len, page=page, dtype=torch.float16, kv_dtype=kv, seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={**cfg, "swap_ab": 1})
    _close(out, lse, ref_out, ref_lse, 1e-5)
    row_major = _decode(p, TRITON_DECODE, config={**cfg, "swap_ab": 0})
    torch.testing.assert_close(out, row_major[0], atol=2e-3, rtol=1e-3)

def test_auto_knobs_reproduce_the_measured_h200_choice(monkeypatch):
    # the defaults were picked on an H200 (132 SMs) at B=128, seqlen 8192: 16 heads -> 8 splits, 4 warps,
    # BLOCK_N 32, fp8 pools in fp16; 128 heads -> 64-head programs, 2 splits, 8 warps, BLOCK_N 64, fp8 pools in bf16
    from pdlab.attention import triton_kernels as tk
    from pdlab.attention.backends.triton_mla import DECODE_DEFAULT, _warps

    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    # (_mla_fwd's knobs: with kernel "auto" the waves stay 0 and the launcher picks them by the kernel it runs)
    assert _warps(DECODE_DEFAULT, 16)["waves"] == 0
    triton_only = {**DECODE_DEFAULT, "kernel": "triton"}
    c16 = _warps(triton_only, min(DECODE_DEFAULT["BLOCK_H"], 16))
    assert c16["num_warps"] == 4 and tk._tile(16, 1, c16["BLOCK_H"], True) == (1, 16)
    assert tk.auto_splits(128, 1, 1, 8192, torch.device("cpu"), c16["waves"]) == 8
    assert c16["BLOCK_N"] == 32 and c16["tile_in_page"] == 1 and c16["fp8_compute"] == "fp16"
    c128 = _warps(triton_only, min(DECODE_DEFAULT["BLOCK_H"], 128))
    assert c128["BLOCK_N"] == 64 and c128["fp8_compute"] == "bf16"
    assert c128["d_quarters"] == 0 and c128["page_ahead"] == 0  # a 16-bit pool: neither (both slower there)
    assert _warps({**DECODE_DEFAULT, "fp8_compute": "fp16"}, 64)["fp8_compute"] == "fp16"  # explicit stays
    # an fp8 pool: column quarters, page ids a tile ahead, and fp16 compute at every row count
    f128 = _warps(DECODE_DEFAULT, 64, fp8=True)
    assert (f128["d_quarters"], f128["page_ahead"], f128["fp8_compute"]) == (1, 1, "fp16")
    # q rescaled to fp16 before the launch: over fp8 pools with more than 32 rows (not at 16 heads, not over bf16)
    assert f128["q_prescale"] == 1 and _warps(DECODE_DEFAULT, 16, fp8=True)["q_prescale"] == 0
    assert c128["q_prescale"] == 0
    assert _warps({**DECODE_DEFAULT, "d_quarters": 0}, 64, fp8=True)["fp8_compute"] == "bf16"
    assert c128["num_warps"] == 8 and tk._tile(128, 1, c128["BLOCK_H"], True) == (1, 64)
    assert tk.auto_splits(128, 2, 1, 8192, torch.device("cpu"), c128["waves"]) == 2
    assert tk._tile(128, 2, 64, True) == (2, 32)  # S_q = 2 keeps 64 rows per program


def test_token_major_config_that_crashed_on_sm90_is_refused_with_the_fix():
    # swap_ab=1, BLOCK_N 64, one stage gave an illegal memory access on an H200 (Triton 3.6): refused
    # before launch, with what to change, instead of breaking the CUDA context
    p = decode_problem([70], heads=16, q_len=1, page=64, dtype=torch.float16, kv_dtype="same", seed=0)
    with pytest.raises(ValueError, match="num_stages >= 2, BLOCK_N <= 32 or swap_ab=0"):
        _decode(p, TRITON_DECODE, config={"BLOCK_N": 64, "num_stages": 1, "swap_ab": 1})


def test_fp8_upcast_once_runs_the_plain_upcast_under_the_interpreter(seed):
    # the PTX conversion needs an sm89+ GPU; the interpreter (and any older device) takes the plain path
    p = decode_problem([9, 40], heads=16, q_len=1, page=16, dtype=torch.bfloat16, kv_dtype="fp8", seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 16, "fp8_compute": "fp16", "fp8_upcast": "once"})
    assert cosine_error(out, ref_out) < 1e-5 and torch.allclose(lse, ref_lse, atol=1e-2)


@pytest.mark.parametrize("page,splits", [(16, 1), (16, 3), (64, 2), (4, 1)])
def test_fp8_register_prefetch_matches_the_reference(page, splits, seed):
    # fp8_upcast="prefetch" loads tile i+1 while tile i is computed; the prefetch past the last tile of a
    # split must read nothing (NaN pages past each sequence would poison the output) at any page size
    p = decode_problem([1, 16, 17, 63, 100], heads=16, q_len=1, page=page, dtype=torch.bfloat16, kv_dtype="fp8",
                       seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    # (the whole tile per dot on both sides: the fp8 default's column quarters would sum in another order)
    cfg = {"BLOCK_N": 16 if page >= 16 else 8, "fp8_compute": "fp16", "num_splits": splits, "d_quarters": 0}
    out, lse = _decode(p, TRITON_DECODE, config={**cfg, "fp8_upcast": "prefetch"})
    plain_out, plain_lse = _decode(p, TRITON_DECODE, config={**cfg, "fp8_upcast": "inline"})
    # the same arithmetic on the same tiles, only loaded one iteration earlier: bit-equal
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    # bf16 output: its rounding alone costs up to ~1e-5 of cosine error on these sizes
    assert cosine_error(out, ref_out) < 3e-5 and torch.allclose(lse, ref_lse, atol=1e-2)


@pytest.mark.parametrize("kv_dtype,page,splits,knobs", [
    ("fp8", 16, 1, {"d_quarters": 1}), ("fp8", 64, 3, {"d_quarters": 1, "page_ahead": 1}),
    ("fp8", 64, 2, {"d_quarters": 1, "page_ahead": 1, "q_prescale": 1}),
    ("same", 16, 2, {"d_quarters": 1}), ("same", 4, 1, {"d_quarters": 1, "page_ahead": 1}),
    ("fp8", 16, 3, {"page_ahead": 1}), ("same", 64, 2, {"page_ahead": 1}),
    ("same", 16, 1, {"page_ahead": 1, "swap_ab": 1})])
def test_decode_in_column_quarters_and_page_ahead_match_the_reference(kv_dtype, page, splits, knobs, seed):
    # d_quarters=1: q, the tile and the accumulator in four column quarters, one dot per quarter; the
    # quarters must be joined back in order (a swapped quarter shows up as a large error). page_ahead=1: each
    # tile's page id is read one iteration early; the read past a split's last tile must not happen and a
    # late page id would attend the wrong page. Pages past each sequence are NaN and must not be read.
    # (the interpreter computes bf16 dots wrongly: a bf16 cache is tested as fp16, fp8 in fp16 compute)
    dtype = torch.bfloat16 if kv_dtype == "fp8" else torch.float16
    p = decode_problem([1, 16, 17, 63, 100], heads=16, q_len=1, page=page, dtype=dtype, kv_dtype=kv_dtype, seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    cfg = {"BLOCK_N": 16 if page >= 16 else 4, "fp8_compute": "fp16", "num_splits": splits, **knobs}
    out, lse = _decode(p, TRITON_DECODE, config=cfg)
    assert cosine_error(out, ref_out) < 3e-5 and torch.allclose(lse, ref_lse, atol=1e-2)


def test_a_config_too_big_for_shared_memory_gets_an_error_naming_the_knobs(monkeypatch):
    # page_ahead keeps num_stages - 1 KV tiles in flight: at 128 heads with a 16-bit cache and 3 stages that is
    # more shared memory than an H200 has (seen there). The launcher's error names the knobs to lower.
    from triton.runtime.errors import OutOfResources

    from pdlab.attention import triton_kernels as tk

    class _TooBig:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(294912, 232448, "shared memory")
            return launch

    monkeypatch.setattr(tk, "_mla_fwd", _TooBig())
    p = decode_problem([70], heads=16, q_len=1, page=64, dtype=torch.float16, kv_dtype="same", seed=0)
    with pytest.raises(ValueError, match="lower num_stages, BLOCK_N or BLOCK_H, or set page_ahead=0"):
        _decode(p, TRITON_DECODE, config={"BLOCK_N": 32, "page_ahead": 1})


@pytest.mark.parametrize("q_len,heads", [(2, 16), (4, 8)])
def test_fp8_default_with_several_new_tokens_matches_the_reference(q_len, heads, seed):
    # the fp8 default (column quarters, page id a tile ahead, fp16 compute) at S_q 2 / 4: rows of one program
    # belong to different query tokens with different causal limits; 32 rows sum independent q·k chains,
    # 64 rows one chain
    p = decode_problem([4, 17, 64, 65, 130], heads=heads, q_len=q_len, page=64, dtype=torch.bfloat16,
                       kv_dtype="fp8", seed=seed)
    ref_out, ref_lse = _decode(p, "torch")
    out, lse = _decode(p, TRITON_DECODE, config={"BLOCK_N": 32})
    assert cosine_error(out, ref_out) < 3e-5 and torch.allclose(lse, ref_lse, atol=1e-2)


def test_prefill_default_splits_only_a_launch_that_leaves_sms_idle(monkeypatch):
    # the prefill default (num_splits 0, waves 1) splits each sequence's KV as far as the programs still fit in one
    # wave: one prompt of 256 new tokens over a 4096-token prefix at 16 heads is 64 programs of BLOCK_T 4 on an H100's
    # 132 SMs -> 2 splits (the tuner's winner there, 1.59x over unsplit); launches that fill the GPU, or a pool too
    # short for a split of 256 tokens, stay unsplit (splitting lost there in the same study)
    from pdlab.attention import triton_kernels as tk
    from pdlab.attention.backends.triton_mla import PREFILL_DEFAULT

    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    assert PREFILL_DEFAULT["num_splits"] == 0
    cpu, waves = torch.device("cpu"), PREFILL_DEFAULT["waves"]
    assert tk.auto_splits(1, 1, 256 // 4, 4352, cpu, waves, within=True) == 2
    assert tk.auto_splits(1, 1, 256 // 4, 256, cpu, waves, within=True) == 1  # the pool holds one split's worth
    assert tk.auto_splits(1, 1, 2048 // 4, 6144, cpu, waves, within=True) == 1  # 512 programs
    assert tk.auto_splits(1, 8, 256 // 4, 4352, cpu, waves, within=True) == 1  # 128 heads: 8 head blocks
    assert tk.auto_splits(8, 1, 256 // 4, 4352, cpu, waves, within=True) == 1
    assert tk.auto_splits(1, 1, 8, 16384, cpu, waves, within=True) == 16  # 8 programs
    assert tk.auto_splits(1, 1, 256 // 4, 4352, cpu, waves) == 3  # decode's rounding: past one wave


def test_prefill_default_split_matches_the_reference(monkeypatch, seed):
    # a few new tokens over a long prefix leave the CPU's 4 "SMs" idle: the default splits the KV (spied) and the
    # lse combine must give the reference's out and lse, NaN poisoned rows past each length unread
    from pdlab.attention import triton_kernels as tk

    chosen = []
    real = tk.auto_splits

    def spy(*args, **kwargs):
        chosen.append(real(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(tk, "auto_splits", spy)
    p = prefill_problem([600], [4], heads=16, page=64, dtype=torch.float32, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref_out, ref_lse = mla_prefill(*args, backend="torch")
    out, lse = mla_prefill(*args, backend=TRITON_PREFILL, max_q_len=p.max_q_len)
    assert chosen == [2]
    _close(out, lse, ref_out, ref_lse, 1e-5)


@pytest.mark.parametrize("page", [64, 16])
def test_prefill_default_config_at_deepseek_head_counts(page, seed):
    # the default's BLOCK_N 0 resolves by rows per program: BLOCK_T 4 x 16 heads = 64 rows take 64-token KV tiles (a
    # page of 16 is read tile by tile across pages); poisoned rows past each length must stay unread
    from pdlab.attention.backends.triton_mla import PREFILL_DEFAULT, _warps

    assert _warps(PREFILL_DEFAULT, 4 * 16)["BLOCK_N"] == 64 and _warps(PREFILL_DEFAULT, 4 * 4)["BLOCK_N"] == 32
    p = prefill_problem([70, 9, 1], [6, 9, 1], heads=16, page=page, dtype=torch.float32, seed=seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.qo_indptr, p.softmax_scale)
    ref_out, ref_lse = mla_prefill(*args, backend="torch")
    out, lse = mla_prefill(*args, backend=TRITON_PREFILL, max_q_len=p.max_q_len)
    _close(out, lse, ref_out, ref_lse, 1e-5)
