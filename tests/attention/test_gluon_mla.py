"""The Gluon fp8 MLA decode kernel (attention/gluon_mla.py): q's exact e4m3 parts, the shared tile view (wgmma's
swizzle, no bank conflicts), its selection rule and its compiled shape on any machine; against the torch reference
on a Hopper GPU (page sizes, S_q, splits, ragged lengths with NaN-poisoned pages past them, scale as a float or a
tensor). Bar: 1e-5 cosine error against the reference on the
same e4m3 bytes (tests/attention/test_gpu.py says why the fp8 bar is the bf16 one)."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from pdlab.attention import gluon_mla as G
from pdlab.attention import mla_decode, quantize_kv_fp8
from pdlab.attention import triton_kernels as tk
from pdlab.attention.backends.triton_mla import DECODE_DEFAULT, _warps
from pdlab.attention.workloads import decode_problem
from pdlab.bench.harness import cosine_error
from pdlab.kernels.arch import SM90


@pytest.mark.parametrize("dtype,parts,exact_from", [(torch.bfloat16, 2, 2.0 ** -2), (torch.float16, 4, 2.0)])
def test_query_parts_sum_to_the_query_exactly(dtype, parts, exact_from, seed):
    # a query row scaled into (128, 256] is the sum of its e4m3 parts: exactly down to the smallest elements' last
    # part reaching e4m3's subnormals, within 2^-10 below; every part an e4m3 value
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 576, generator=g) * torch.logspace(-6, 2, 64)[:, None]).to(dtype).float()
    x = x * torch.exp2(-torch.ceil(torch.log2(x.abs().amax(1, keepdim=True) / 256)))  # the kernel's row factor
    x = x.to(dtype).float()  # still the dtype's values (a power of two)
    assert x.abs().max() <= 256 and (x.abs().amax(1) > 128).all()
    p = G.q_parts_reference(x, parts)
    assert torch.equal(p, p.to(torch.float8_e4m3fn).float())
    err = (p.sum(0) - x).abs()
    assert err[x.abs() >= exact_from].max() == 0 and err.max() <= 2.0 ** -10
    # fewer parts than the dtype needs are not exact
    assert (G.q_parts_reference(x, parts // 2).sum(0) != x).any()


def test_e4m3_rounding_by_bits_is_torchs():
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([2.0 ** -6, 0.5625 + 2.0 ** -5, 240, 256, -448])
    x = torch.cat([torch.randn(100000, generator=g) * 40, edges])
    x = x[x.abs() >= 2.0 ** -6]
    assert torch.equal(G.q_parts_reference(x, 2)[0], x.to(torch.float8_e4m3fn).float())


def _shared_offsets():
    """{(token, column): byte offset} of the latent tile's view (XOR of the bases of the offset's bits)."""
    where = {}
    for off in range(64 * 512):
        tok = col = 0
        for bit, (t, c) in enumerate(G.NOPE_VIEW_BASES):
            if off >> bit & 1:
                tok, col = tok ^ t, col ^ c
        where[tok, col] = off
    return where


def test_latent_tile_view_is_wgmmas_layout_and_free_of_bank_conflicts():
    where = _shared_offsets()
    assert len(where) == 64 * 512 and set(where.values()) == set(range(64 * 512))
    for tok in range(64):
        for col in range(512):  # four [64, 128] blocks 8 KB apart, each in the 128-byte swizzle (wgmma's, TMA's)
            blk, c = divmod(col, 128)
            assert where[tok, col] == blk * 8192 + tok * 128 + (((c // 16) ^ (tok % 8)) * 16) + c % 16

    def conflict_free(pieces):  # one quarter-warp's 16-byte accesses: eight different 16-byte bank groups
        return len({(where[p] >> 4) % 8 for p in pieces}) == 8

    for w in range(4):
        for quarter in range(4):
            lanes = range(8 * quarter, 8 * quarter + 8)
            # the copies: lane 8t + 4l + c copies tokens 16w + t + 4l + 8j, pieces c + 4h of block b
            for j in range(2):
                for h in range(2):
                    for b in range(4):
                        tok = [16 * w + l // 8 + 4 * ((l // 4) % 2) + 8 * j for l in lanes]
                        assert conflict_free([(t, 128 * b + 16 * (l % 4 + 4 * h)) for t, l in zip(tok, lanes)])
            # V^T fragments: lane 4·rlo + q reads token 2q + c + 8·t3 + 16·kk, columns 128w + 16·rlo
            for c in range(2):
                for t3 in range(2):
                    for kk in range(4):
                        assert conflict_free([(2 * (l % 4) + c + 8 * t3 + 16 * kk, 128 * w + 16 * (l // 4))
                                              for l in lanes])


def test_value_rows_cover_every_latent_column_once():
    # accumulator i, row r = 16w + 8·rsel + rlo holds latent column 128w + 16·rlo + 2i + rsel
    cols = sorted(128 * (r // 16) + 16 * (r % 8) + 2 * i + (r // 8) % 2 for i in range(8) for r in range(64))
    assert cols == list(range(512))


def _q(device="cpu", dtype=torch.bfloat16, heads=16):
    return torch.zeros(2, heads, 576, dtype=dtype, device=device)


def test_selection_rule_and_its_reasons():
    # "auto" runs the kernel only where it can; "gluon" where it cannot says why and how to get on
    kv8, kv16 = torch.zeros(4, 64, 576, dtype=torch.uint8), torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert tk._gluon_kernel({"kernel": "triton"}, True, 1, 16, _q(), kv8) is None
    assert tk._gluon_kernel({"kernel": "auto"}, True, 1, 16, _q(), kv8) is None  # no GPU here
    with pytest.raises(ValueError, match="kernel=.gluon. cannot run here: .*kernel=.triton."):
        tk._gluon_kernel({"kernel": "gluon"}, True, 1, 16, _q(), kv8)
    with pytest.raises(ValueError, match="decode kernel for fp8 pools"):
        tk._gluon_kernel({"kernel": "gluon"}, False, 1, 16, _q(), kv16)
    with pytest.raises(ValueError, match="128 heads × S_q 1 exceed the 32 query rows"):
        tk._gluon_kernel({"kernel": "gluon"}, True, 1, 128, _q(heads=128), kv8)
    with pytest.raises(ValueError, match="decode kernel"):  # prefill (ragged queries)
        tk._gluon_kernel({"kernel": "gluon"}, True, 0, 16, _q(), kv8)
    with pytest.raises(ValueError, match="kernel='wgmma'"):
        tk._gluon_kernel({"kernel": "wgmma"}, True, 1, 16, _q(), kv8)
    assert G.rows_fit(16, 2) and G.rows_fit(32, 1) and not G.rows_fit(16, 4)
    assert G.program_rows(16, 1) == 16 and G.program_rows(8, 1) == 16 and G.program_rows(16, 2) == 32


def test_auto_splits_fill_the_program_slots_without_needless_partials():
    # H200: 132 SMs × 2 programs. B=128 → 2 splits (256 programs, one wave: measured best, 0.193 ms at 8k); B=64 at
    # 16k → 4, not 33 (the same number of waves with 8× the partials: 0.273 → 0.192 ms); a lone sequence is cut into
    # as many 256-token pieces as its pool allows
    assert G.auto_splits(128, 16, 1, 8192, 132) == 2
    assert G.auto_splits(64, 16, 1, 16384, 132) == 4
    assert G.auto_splits(1, 16, 1, 8192, 132) == 32
    assert G.auto_splits(256, 16, 1, 8192, 132) == 1
    assert G.auto_splits(8, 16, 1, 1024, 132) == 4


def test_balanced_schedule_spreads_the_batch_over_one_wave_by_length():
    slots = 264  # an H200: 132 SMs × 2 programs
    # uniform lengths: the split counts the uniform schedule's auto rule picks (B=128 8k: 2; B=64 16k: 4; B=32 8k: 8)
    assert G.balanced_schedule([8192] * 128, slots) == [2] * 128
    assert G.balanced_schedule([16384] * 64, slots) == [4] * 64
    assert G.balanced_schedule([8192] * 32, slots) == [8] * 32
    assert G.balanced_schedule([1024] * 64, slots) == [4] * 64  # the even share: 256 of the 264 slots
    assert G.balanced_schedule([8192], slots) == [8192 // 64 // G.MIN_SPAN_TILES] == [32]
    # ragged: programs follow the length, every program of about the same number of tiles, one wave whatever the mix
    counts = G.balanced_schedule([16384] + [1024] * 63, slots)
    assert counts[0] >= 10 * counts[1] and sum(counts) <= slots
    rng = random.Random(0)
    for _ in range(300):
        B = rng.randint(1, 263)
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 40000)]) for _ in range(B)]
        counts = G.balanced_schedule(lens, slots, max_splits=slots)  # uncapped: every program ≤ P tiles
        assert min(counts) >= 1 and sum(counts) <= slots, (B, sum(counts))
        per = [-(-(-(-n // 64)) // c) for n, c in zip(lens, counts)]  # tiles per program of each sequence
        assert max(per) <= max(G.MIN_SPAN_TILES, -(-sum(-(-n // 64) for n in lens) // (slots - B)))
    assert G.balanced_fits(263, 264) and not G.balanced_fits(264, 264) and not G.balanced_fits(0, 264)
    # the grid's programs per sequence: 4× the even share, at most 64 and the pool's tiles; the schedule keeps to it
    assert G.balanced_max_splits(128, slots, 8192) == 4 and G.balanced_max_splits(1, slots, 8192) == 32
    assert G.balanced_max_splits(8, slots, 1024) == 4
    assert G.balanced_schedule([32768] + [1024] * 127, slots, 4) == [4] + [1] * 127


def _span_partial(q, kv, seqlen, lo, hi, scale):
    """fp32 attention of the S_q query rows q [S_q, H, 576] of a sequence over its cached rows kv [seqlen, 576]
    at positions [lo, hi) (causal among the last S_q): (o [S_q, H, 512] normalised, lse [S_q, H] natural log)."""
    sq, H, _ = q.shape
    o = torch.zeros(sq, H, 512)
    lse = torch.full((sq, H), float("-inf"))
    for j in range(sq):
        top = min(hi, seqlen - sq + j + 1)
        if top <= lo:
            continue
        s = q[j] @ kv[lo:top].T * scale  # [H, n]
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        o[j] = (e @ kv[lo:top, :512]) / e.sum(-1, keepdim=True)
        lse[j] = (m + e.sum(-1, keepdim=True).log()).squeeze(-1)
    return o, lse


@pytest.mark.parametrize("q_len", [1, 2])
def test_balanced_combine_merges_the_programs_of_each_sequence(q_len):
    # the partials of the balanced schedule's programs (fp32 reference of each span), merged by `_mla_combine` over
    # each sequence's count under the interpreter, equal the reference decode; sequences of one program (their
    # result written by the kernel itself) are left alone, and partials past a count (unwritten: NaN) are ignored
    slots, H = 24, 4
    lens = [700, 70, 2, 65, 300, 128]
    p = decode_problem(lens, H, q_len, 16, torch.float32, seed=1)
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, backend="torch")
    splits = 4  # the grid's programs per sequence (≥ the schedule's counts)
    counts = G.balanced_schedule(lens, slots, splits)
    assert max(counts) > 2 and min(counts) == 1
    B = len(lens)
    o_part, lse_part = tk.balanced_partials(B, splits, q_len, H, "cpu")
    o_part.fill_(float("nan"))
    lse_part.fill_(float("nan"))
    meta = torch.zeros(B, 2, dtype=torch.int32)
    out = torch.full((B * q_len, H, 512), 7.0)
    lse = torch.full((B, H, q_len), 7.0)
    for b, (n, c) in enumerate(zip(lens, counts)):
        pos = torch.arange(n)
        kv = p.kv_cache[p.block_table[b].long()[pos // 16], pos % 16].float()
        span = -(-(-(-n // 64)) // c) * 64
        meta[b] = torch.tensor([b * splits, c])
        for k in range(c):
            o_part[b, k], lse_part[b, k] = _span_partial(p.q[b], kv, n, k * span, min((k + 1) * span, n),
                                                         p.softmax_scale)
    tk._combine(out, lse, o_part, lse_part, None, (H, 1, q_len), q_len, splits, False, counts=meta[:, 1])
    out = out.view(B, q_len, H, 512)
    for b, c in enumerate(counts):
        if c == 1:
            assert (out[b] == 7.0).all() and (lse[b] == 7.0).all()
        else:
            assert cosine_error(out[b], ref[0][b]) < 1e-6 and cosine_error(lse[b], ref[1][b]) < 1e-6


def test_the_balanced_schedule_runs_when_asked_and_where_it_fits(monkeypatch):
    # schedule "balanced", or the default ("auto") from BALANCED_MIN_BATCH sequences: one launch over the balanced
    # grid with [B, 2] metadata, then the combine over each sequence's count; "uniform", "auto" below that, or more
    # sequences than slots: the split grid with the plain combine
    from pdlab.attention.backends.triton_mla import resolve_decode_config

    launches, combines = [], []

    class _Rec:  # the combine's grid, and whether it merges over per-sequence counts (the balanced schedule's)
        def __getitem__(self, grid):
            return lambda *a, **k: combines.append(("spans" if k["COUNTED"] else "splits", grid))

    monkeypatch.setattr(G, "launch", lambda *a, **k: launches.append(k))
    monkeypatch.setattr(tk, "_mla_combine", _Rec())
    monkeypatch.setattr(tk, "_gluon_kernel", lambda *a, **k: "fp8")
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    H = 16

    def run(B, **knobs):
        q = torch.zeros(B, H, 576, dtype=torch.bfloat16)
        cfg = resolve_decode_config({**DECODE_DEFAULT, "kernel": "gluon", **knobs}, H, 1, True)
        tk.mla_attention(q, torch.zeros(4, 64, 576, dtype=torch.uint8), torch.zeros(B, 4, dtype=torch.int32),
                         torch.full((B,), 200, dtype=torch.int32), None, torch.empty(B, H, 512, dtype=torch.bfloat16),
                         torch.empty(B, H, 1), (H, 1, 1), 576 ** -0.5, 0.05, q_per_seq=1, q_blocks=1, config=cfg)
        return launches[-1], combines[-1] if combines else None

    k, c = run(3, num_splits=5, schedule="balanced")  # num_splits is the uniform schedule's: ignored here
    assert k["slots"] == 264 and k["meta"].shape == (3, 2) and c == ("spans", (3, H))
    assert k["splits"] == G.balanced_max_splits(3, 264, 4 * 64)
    k, c = run(3, num_splits=5)
    assert k.get("meta") is None and k["splits"] == 5 and c == ("splits", (3, H))
    k, c = run(G.BALANCED_MIN_BATCH)
    assert k["meta"].shape == (G.BALANCED_MIN_BATCH, 2) and c[0] == "spans"
    k, _ = run(G.BALANCED_MIN_BATCH, schedule="uniform")
    assert k.get("meta") is None
    k, _ = run(300, schedule="balanced")
    assert k.get("meta") is None
    with pytest.raises(ValueError, match="schedule='even' is not a schedule"):
        run(3, schedule="even")


def test_a_tuned_gluon_entry_never_fails_a_problem_it_cannot_take(monkeypatch):
    # the store's nearest bucket (q_len 1) says kernel "gluon"; a decode with S_q 4 at 16 heads (64 rows) must run
    # (the Triton kernel), as the served path does with the shipped configs — an explicit "gluon" still refuses
    from pdlab.attention import ops
    from pdlab.kernels import registry

    triton = registry.get_backend("mla_decode", "triton")  # the object: runs under the interpreter here
    p = decode_problem([70, 5], 16, 4, 16, torch.float32, device="cpu", seed=0)
    p.kv_cache, p.kv_scale = quantize_kv_fp8(p.kv_cache, 0.05), 0.05
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, kv_scale=p.kv_scale, backend="torch")
    tuned = {**DECODE_DEFAULT, "kernel": "gluon", "num_splits": 2}
    def resolve(op, b, bucket, device, config=None):  # the store's answer, or an explicit config
        return (dict(tuned), "tuned:NVIDIA_H200/mla_decode.json") if config is None else (b.config(config), "explicit")

    monkeypatch.setattr(ops, "resolve_config", resolve)
    out, lse = mla_decode(*args, kv_scale=p.kv_scale, backend=triton)
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5
    with pytest.raises(ValueError, match="kernel='gluon' cannot run here"):
        mla_decode(*args, kv_scale=p.kv_scale, backend=triton, config=tuned)


def test_waves_stay_auto_for_a_decode_that_may_run_the_gluon_kernel():
    # the launcher picks 2 waves for the Gluon kernel (one program per SM) and keeps 7.5 / 2 by rows for _mla_fwd
    assert _warps(DECODE_DEFAULT, 16, fp8=True)["waves"] == 0
    assert _warps({**DECODE_DEFAULT, "kernel": "triton"}, 16, fp8=True)["waves"] == 7.5
    assert _warps(DECODE_DEFAULT, 16, fp8=False)["waves"] == 0  # may run the 16-bit Gluon kernel (S_q 4)
    assert _warps({**DECODE_DEFAULT, "kernel": "triton"}, 128, fp8=False)["waves"] == 2.0


def test_shared_memory_and_query_dtype():
    # two programs per SM at 16 and 32 rows with bf16 queries and at 16 with fp16 (four parts); one at 32 with fp16
    assert [G.programs_per_sm(hm, qp) for hm, qp in ((16, 2), (32, 2), (16, 4), (32, 4))] == [2, 2, 2, 1]
    assert G.shared_bytes(16) == 2 * 36864 + 2 * 16 * 576 + 16 * 128
    q = _q().float()
    kv = torch.zeros(4, 64, 576, dtype=torch.uint8)
    with pytest.raises(ValueError, match="queries of torch.float32 are not taken"):
        G.launch(q, kv, torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                 torch.empty(2, 16, 512), torch.empty(2, 16, 1), q, q, (16, 1, 1), (0,) * 5, 1.0, 1.0, None,
                 q_per_seq=1, splits=1)


_COMPILE = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from pdlab.bench.kernel_resources import _disassemble, _ptxas_usage, sass_opcodes
from pdlab.attention import gluon_mla as G
hm, qparts, final, balanced = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
names = G._mla_fp8_decode.arg_names
ptrs = {"Q": "*bf16", "KV": "*u8", "BT": "*i32", "SEQLENS": "*i32", "O": "*bf16", "LSE": "*fp32",
        "O_PART": "*fp32", "LSE_PART": "*fp32", "META": "*i32", "KV_SCALE_PTR": "*i32"}
sig = {n: ptrs.get(n, "fp32" if n in ("kv_scale", "qk_scale") else "i32") for n in names}
consts = {"Q_PER_SEQ": 1, "BLOCK_H": hm, "HM": hm, "PAGE": 64, "FINAL": final, "SCALE_FROM_PTR": False,
          "OUT_LAYOUT": G.out_layout(hm), "BALANCED": balanced, "BLOCK_B": 128, "QPARTS": qparts,
          "CHAINS": G.QK_CHAINS[qparts * hm]}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n].startswith("*") or n.startswith("stride")}
sig.update({k: "constexpr" for k in consts})
k = triton.compile(GluonASTSource(fn=G._mla_fp8_decode, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
regs, spill = _ptxas_usage(k.asm["ptx"], 90)
sass = _disassemble(k.asm["cubin"])
ops = {}
for line in sass.splitlines():
    for name in ("F2FP.F16.E4M3.UNPACK", "LDGSTS.E.BYPASS.128", "LDS.128", "HGMMA.64x%dx16.F32" % hm, "STG.E.128",
                 "QGMMA.64x%dx32.F32.E4M3.E4M3" % (qparts * hm), "BAR.SYNC", "PRMT"):
        if name in line:
            ops[name] = ops.get(name, 0) + 1
print(json.dumps({"shared": k.metadata.shared, "regs": regs, "spill": spill, "ops": ops}))
"""


@pytest.mark.skipif(not G.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("final,balanced", [(False, False), (True, False), (False, True)])
def test_compiles_for_sm90_two_programs_per_sm(final, balanced):
    # compiled for sm90 on any machine (its own process). Per tile and thread: its 16 + 2 pieces copied by cp.async
    # (the prologue's tile and the loop's: 36 copies in the code); q·k as 18 e4m3 wgmma (four 128-column blocks and
    # the rope block, K 32 each) straight from shared memory, no conversion; V^T read back by 16 16-byte shared loads
    # and converted once (128 e4m3x2 conversions), one byte permute per fragment register pair; 32 fp16 wgmma; the
    # output written 16 bytes at a time. No spills, and shared memory for two programs per SM. The balanced schedule
    # has both epilogues (the result of a sequence of one program, else the partial)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, "16", "2", str(int(final)), str(int(balanced))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    ops = got["ops"]
    assert ops["QGMMA.64x32x32.F32.E4M3.E4M3"] == 18 and ops["F2FP.F16.E4M3.UNPACK"] == 128, ops
    assert ops["HGMMA.64x16x16.F32"] == 32 and ops["LDGSTS.E.BYPASS.128"] == 36 and ops["LDS.128"] >= 16, ops
    # 4 rows × 16 columns per thread: fp32 partials in 16 stores, the bf16 output in 8
    assert ops["STG.E.128"] == (24 if balanced else 8 if final else 16) and ops["PRMT"] <= 110, ops
    assert got["spill"] == 0, got
    assert G.shared_bytes(16) <= got["shared"] <= G.shared_bytes(16) + 1024, got
    assert G.programs_per_sm(16) == 2 and G.programs_per_sm(32) == 2


# ---------------------------------------------------------------------------------------------------- GPU

def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return G.available(torch.device("cuda"))


def _fp8_problem(lens, heads, q_len, page, seed, q_dtype=torch.bfloat16):
    p = decode_problem(lens, heads, q_len, page, q_dtype, device="cuda", seed=seed)
    scale = float(p.kv_cache.float().nan_to_num(0).abs().max()) / 448
    p.kv_cache, p.kv_scale = quantize_kv_fp8(p.kv_cache, scale), scale  # NaN poison stays NaN (0x7F)
    return p


def _lens(B, top, q_len, rng):
    fixed = [q_len, 63, 64, 65, 128, top]
    return [max(q_len, n) for n in fixed + [rng.randint(1, top) for _ in range(B - len(fixed))]]


_U = {"schedule": "uniform"}
_BAL = {"schedule": "balanced"}


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,page,cfg", [
    (16, 1, 64, {}), (16, 1, 64, {"num_splits": 1, **_U}), (16, 1, 64, {"num_splits": 7, "num_stages": 2, **_U}),
    (16, 2, 64, {}), (32, 1, 64, {"num_splits": 3, **_U}), (8, 4, 64, {}), (16, 1, 1, {"num_splits": 2, **_U}),
    (16, 1, 16, {}), (16, 1, 128, {"num_splits": 5, **_U}), (16, 1, 32, {"num_stages": 2}), (10, 1, 64, {}),
    (16, 1, 64, {"num_splits": 64, **_U}),  # splits past the end of short sequences: empty partials
    (16, 1, 64, _BAL), (16, 2, 128, _BAL), (16, 1, 1, _BAL), (32, 1, 64, _BAL), (8, 4, 16, _BAL),
])
def test_gpu_gluon_decode_matches_the_reference(heads, q_len, page, cfg, seed):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = _fp8_problem(_lens(24, 3000, q_len, rng), heads, q_len, page, seed)
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                     backend="torch")
    out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                          backend="triton", config={"kernel": "gluon", **cfg})
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


def _growing_scores(p, growth: float, q_gain: float):
    """Scale each sequence's cache row at position t by 1 + growth · t / seqlen and q by q_gain (re-quantized), so
    that a row's running max grows along the sequence: by more than the kernel's lazy-rescale threshold
    (RESCALE_LOG2) at some tiles, by less at others."""
    from pdlab.attention.kv import dequantize_kv_fp8

    kv = dequantize_kv_fp8(p.kv_cache, p.kv_scale)
    page = kv.shape[1]
    for b, n in enumerate(p.seqlens.tolist()):
        pos = torch.arange(p.block_table.shape[1] * page, device=kv.device)
        pages = p.block_table[b].long().repeat_interleave(page)
        kv[pages, pos % page] *= (1 + growth * pos / n)[:, None]
    scale = float(kv.nan_to_num(0).abs().max()) / 448
    p.kv_cache, p.kv_scale = quantize_kv_fp8(kv, scale), scale
    p.q *= q_gain
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,q_len,splits", [(16, 1, 1), (16, 1, 3), (16, 2, 1), (32, 1, 2)])
def test_gpu_gluon_decode_with_scores_growing_along_the_sequence(heads, q_len, splits, q_dtype, seed):
    # splits 1: the balanced schedule; more: the uniform one
    # the running max moves by more than RESCALE_LOG2 at some tiles (o and the row sums rescaled) and by less at
    # others (the stale max kept, p up to 2^RESCALE_LOG2): both against the reference, with NaN past the lengths.
    # Large scores: where fp8 wgmma's own accumulation shows (one accumulator for all 576 columns: up to 1.9e-5;
    # QK_CHAINS: 3e-7 at 16 rows, 3.4e-6 at 32); q in 2 (bf16) or 4 (fp16) e4m3 parts, at 16 and 32 rows
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = _growing_scores(_fp8_problem(_lens(12, 4000, q_len, rng), heads, q_len, 64, seed, q_dtype), growth=6.0,
                        q_gain=4.0)
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                     backend="torch")
    cfg = {"kernel": "gluon", "num_splits": splits, **_U} if splits > 1 else {"kernel": "gluon", **_BAL}
    out, lse = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                          backend="triton", config=cfg)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_decode_scale_tensor_large_q_and_cuda_graph(q_dtype, seed):
    # the scale as a device tensor (graph-safe), q rows far beyond fp16's range in bf16 (rescaled per row by a
    # power of two), and a CUDA graph replay equal to the eager call
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    rng = random.Random(seed)
    p = _fp8_problem(_lens(16, 8192, 1, rng), 16, 1, 64, seed, q_dtype)
    if q_dtype == torch.bfloat16:
        p.q[0] *= 3e5  # |q| ~ 1e5-1e6: overflows fp16 without the per-row factor
    scale_t = torch.tensor([p.kv_scale], device="cuda")
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                     backend="torch")
    cfg = {"kernel": "gluon"}
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    out, lse = mla_decode(*args, kv_scale=scale_t, backend="triton", config=cfg)
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout, glse = mla_decode(*args, kv_scale=scale_t, backend="triton", config=cfg)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, out) and torch.equal(glse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,q_len", [
    ([40000] + [100] * 150 + [3000] * 49, 1),  # one long sequence among many short ones, B near the slots
    ([30000], 1), ([2, 3, 64, 65], 2), ([9000] * 3 + [1] * 60 + [128] * 60, 1), ([5000, 17, 129] * 30, 2),
])
def test_gpu_balanced_schedule_on_ragged_batches(lens, q_len, seed):
    # the programs follow the lengths (gluon_mla.balanced_schedule): against the reference with NaN past every
    # length, equal to the uniform schedule's result within rounding, and the same in a CUDA graph
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    p = _fp8_problem([max(n, q_len) for n in lens], 16, q_len, 64, seed)
    args = (p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale)
    ref = mla_decode(*args, kv_scale=p.kv_scale, backend="torch")
    out, lse = mla_decode(*args, kv_scale=p.kv_scale, backend="triton", config={"kernel": "gluon", **_BAL})
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert cosine_error(out, ref[0]) < 1e-5 and cosine_error(lse, ref[1]) < 1e-5, \
        (cosine_error(out, ref[0]), cosine_error(lse, ref[1]))
    uni = mla_decode(*args, kv_scale=p.kv_scale, backend="triton", config={"kernel": "gluon", **_U})
    assert cosine_error(out, uni[0]) < 1e-6
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout, glse = mla_decode(*args, kv_scale=p.kv_scale, backend="triton", config={"kernel": "gluon", **_BAL})
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, out) and torch.equal(glse, lse)


@pytest.mark.gpu
def test_gpu_default_decode_over_fp8_at_16_heads_runs_the_gluon_kernel(seed, monkeypatch):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    calls = []
    real = G.launch
    monkeypatch.setattr(G, "launch", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    p = _fp8_problem([100, 5000], 16, 1, 64, seed)
    out, _ = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                        backend="triton", config={})
    assert len(calls) == 1
    ref = mla_decode(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale,
                     backend="torch")
    assert cosine_error(out, ref[0]) < 1e-5
