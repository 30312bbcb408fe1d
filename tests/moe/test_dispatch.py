"""Dispatch/combine: local round trips vs dense references, payload error bounds, de-duplication
per rank, NCCL backend over gloo ranks (one deliberately slow), call-time errors."""

import pytest
import torch

from pdlab.kernels import registry
from pdlab.kernels.contracts import ShapeError
from pdlab.moe.dispatch import create_dispatcher, payload_row_bytes, quantize_tokens
from pdlab.moe.dispatch.selftest import dispatch_cases, fail_on_rank, global_tokens
from pdlab.moe.dispatch.spawn import RankFailed, run_ranks
from pdlab.moe.layouts import Contiguous, Masked, dequantize_hidden, with_hidden

H, E, K = 256, 12, 4  # E divisible by 2, 3 and 4 ranks
GS = torch.tensor(448 * 6 / 5.0)


def _inputs(T=11, seed=0):
    x, ids, w = global_tokens(seed, 1, T, H, E, K)
    return x, ids, w


def _identity(layout):
    return with_hidden(layout, dequantize_hidden(layout, torch.float32))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_local_roundtrip_bf16_is_x_times_weight_sum(mode):
    x, ids, w = _inputs()
    d = create_dispatcher("local", E, H, mode=mode, num_max_dispatch_tokens_per_rank=16)
    layout, handle = d.dispatch(x, ids, w, "bf16")
    assert isinstance(layout, Contiguous if mode == "normal" else Masked)
    out = d.combine(_identity(layout), handle)
    torch.testing.assert_close(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_local_layout_groups_rows_by_expert():
    x, ids, w = _inputs(T=9)
    d = create_dispatcher("local", E, H, mode="normal")
    layout, _ = d.dispatch(x, ids, w, "bf16")
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert layout.counts.tolist() == counts.tolist()
    for e in range(E):
        rows = layout.hidden[layout.offsets[e]:layout.offsets[e + 1]]
        toks = (ids == e).any(1).nonzero().flatten()
        torch.testing.assert_close(rows, x[toks])  # each expert's tokens, in token order


def test_masked_rows_beyond_masked_m_are_never_read():
    x, ids, w = _inputs()
    d = create_dispatcher("local", E, H, mode="low_latency", num_max_dispatch_tokens_per_rank=16)
    layout, handle = d.dispatch(x, ids, w, "bf16")
    # the rows bound the slab carries (what the experts size their grids by): each token's top-k slots
    assert layout.max_rows == x.shape[0] * ids.shape[1] >= int(layout.masked_m.sum())
    assert with_hidden(layout, layout.hidden).max_rows == layout.max_rows
    y = layout.hidden.clone()
    keep = torch.arange(y.shape[1])[None, :] < layout.masked_m[:, None]
    y[~keep] = float("nan")
    out = d.combine(with_hidden(layout, y), handle)
    torch.testing.assert_close(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_all_tokens_to_one_expert_and_zero_token_experts():
    x, ids, w = global_tokens(3, 1, 10, H, E, K, skew=True)
    for mode in ("normal", "low_latency"):
        d = create_dispatcher("local", E, H, mode=mode, num_max_dispatch_tokens_per_rank=10)
        layout, handle = d.dispatch(x, ids, w, "bf16")
        rows = layout.counts if mode == "normal" else layout.masked_m
        assert rows[0] == 10 and int(rows.sum()) == 10 * K
        layout.check_rows()  # within the slab and its max_rows bound
        assert int((rows == 0).sum()) > 0  # some experts get no token
        torch.testing.assert_close(d.combine(_identity(layout), handle), x * w.sum(1, keepdim=True))


@pytest.mark.parametrize("payload", ["fp8", "nvfp4"])
def test_payload_error_bounds(payload):
    x, ids, w = _inputs(T=32)
    tokens = quantize_tokens(x, payload, GS)
    assert tokens.row_bytes() == payload_row_bytes(payload, H)
    d = create_dispatcher("local", E, H, mode="normal")
    layout, handle = d.dispatch(tokens, ids, w, payload)
    out = d.combine(_identity(layout), handle)
    ref = x * w.sum(1, keepdim=True)
    err = (out - ref).abs()
    # element bound from the block amax: e4m3 keeps 3 mantissa bits (≤ 2^-4 relative, per element);
    # e2m1 steps are ≤ 2 units of amax/6 (half-step 1), scale rounding adds ≤ 1/16
    block = 128 if payload == "fp8" else 16
    amax = x.abs().unflatten(1, (-1, block)).amax(-1).repeat_interleave(block, 1)
    bound = (x.abs() * 2 ** -4 + 1e-6) if payload == "fp8" else amax * (1 / 6) * (1 + 1 / 16) + 1e-6
    assert bool((err <= bound * w.sum(1, keepdim=True) * 1.001).all())
    assert 0 < float((out - ref).norm() / ref.norm()) < (0.05 if payload == "fp8" else 0.15)
    assert payload_row_bytes("bf16", 7168) / payload_row_bytes("nvfp4", 7168) > 3.5


def test_low_latency_rejects_more_tokens_than_its_buffer():
    x, ids, w = _inputs(T=20)
    d = create_dispatcher("local", E, H, mode="low_latency", num_max_dispatch_tokens_per_rank=16)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=16"):
        d.dispatch(x, ids, w, "bf16")


def test_combine_with_the_other_layout_is_a_shape_error():
    x, ids, w = _inputs()
    d = create_dispatcher("local", E, H, mode="normal", num_max_dispatch_tokens_per_rank=16)
    layout, handle = d.dispatch(x, ids, w, "bf16")
    masked, _ = d.dispatch(x, ids, w, "bf16", mode="low_latency")
    with pytest.raises(ShapeError, match="contiguous layout"):
        d.combine(masked, handle)
    with pytest.raises(ShapeError, match="does not match"):
        d.combine(with_hidden(layout, layout.hidden[:-1]), handle)


def test_bad_inputs_are_named():
    x, ids, w = _inputs()
    d = create_dispatcher("local", E, H)
    with pytest.raises(ShapeError, match="topk_weights"):
        d.dispatch(x, ids, w[:, :2], "bf16")
    with pytest.raises(ShapeError, match="hidden size"):
        create_dispatcher("local", E, 2 * H).dispatch(x, ids, w, "bf16")
    with pytest.raises(ValueError, match="global scale"):
        d.dispatch(x, ids, w, "nvfp4")
    with pytest.raises(ValueError, match="payload"):
        d.dispatch(x, ids, w, "int4")


def test_registry_lists_dispatch_backends_with_tuning_spaces():
    names = {b.name: b for b in registry.backends("moe_dispatch")}
    assert {"local", "nccl", "deepep"} <= set(names)
    assert names["nccl"].config_space["num_chunks"] and names["deepep"].config_space["num_sms"]
    assert registry.unavailable_reason("moe_dispatch", "deepep", "cpu")  # CPU: said why


def _reference(seed, world, T, mode, payload, skew=False):
    x, ids, w = global_tokens(seed, world, T, H, E, K, dtype=torch.bfloat16, skew=skew)
    d = create_dispatcher("local", E, H, mode=mode, num_max_dispatch_tokens_per_rank=world * T)
    layout, handle = d.dispatch(x, ids, w, payload, global_scale=GS)
    return d.combine(_identity(layout), handle), ids


def test_nccl_on_gloo_ranks_matches_local_and_dedups_per_rank():
    world, T = 3, 6
    # low latency: the counts exchange, and the fixed one with a buffer larger than the batch (padding rows)
    runs = ([("normal", p, {"num_chunks": 2}) for p in ("bf16", "fp8", "nvfp4")]
            + [("low_latency", p, {"ll_exchange": x}) for p in ("bf16", "fp8", "nvfp4") for x in ("counts", "fixed")])
    cases = [dict(seed=s, mode=m, payload=p, tokens_per_rank=T, hidden=H, num_experts=E, top_k=K,
                  slow_rank=1 if s == 5 else None, skew=(p == "fp8"), config=c,
                  max_tokens=T + 3 if c.get("ll_exchange") == "fixed" else None)
             for s, (m, p, c) in enumerate(runs)]
    results = run_ranks(dispatch_cases, world, kwargs={"cases": cases}, backend="gloo", timeout_s=120)
    for i, case in enumerate(cases):
        ref, ids = _reference(case["seed"], world, T, case["mode"], case["payload"], case["skew"])
        out = torch.cat([results[r][i]["out"] for r in range(world)])
        # partial sums travel back in bf16: one bf16 rounding per (token, rank)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        for r in range(world):
            res = results[r][i]
            row = ((8 * K + payload_row_bytes(case["payload"], H)) + 15) // 16 * 16
            if case["config"].get("ll_exchange") == "fixed":  # the whole buffer to every peer
                assert res["bytes_sent"] == (world - 1) * (T + 3) * row
            else:
                assert res["bytes_sent"] == res["remote_pairs"] * row  # one row per (token, remote rank)
            assert res["layout"] == ("contiguous" if case["mode"] == "normal" else "masked")
        # every (token, expert) pair lands exactly once on its expert's rank
        rows = torch.cat([results[r][i]["per_expert_rows"] for r in range(world)])
        assert rows.sum() == ids.numel()


def test_nccl_two_ranks_with_a_slow_rank_and_an_idle_rank():
    world, T = 2, 5
    cases = [dict(seed=11, mode=m, payload="bf16", tokens_per_rank=T, hidden=H, num_experts=E, top_k=K,
                  slow_rank=0, config=None) for m in ("normal", "low_latency")]
    # rank 0 has no tokens at all (an idle decode rank) but still serves its experts
    cases += [dict(seed=12, mode=m, payload="nvfp4", tokens_per_rank=T, hidden=H, num_experts=E, top_k=K,
                   rank_tokens=[0, 2 * T]) for m in ("normal", "low_latency")]
    results = run_ranks(dispatch_cases, world, kwargs={"cases": cases}, backend="gloo", timeout_s=120)
    assert results[0][2]["out"].shape == (0, H) and results[1][2]["out"].shape == (2 * T, H)
    for i, case in enumerate(cases):
        ref, ids = _reference(case["seed"], world, T, case["mode"], case["payload"])
        out = torch.cat([results[r][i]["out"] for r in range(world)])
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        counts = torch.cat([results[r][i]["per_expert_rows"] for r in range(world)])
        assert counts.tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()


def test_a_failing_rank_surfaces_its_own_traceback():
    with pytest.raises(RankFailed, match="deliberate failure on rank 1") as info:
        run_ranks(fail_on_rank, 2, kwargs={"bad_rank": 1}, backend="gloo", timeout_s=60)
    assert info.value.rank == 1 and "Traceback" in info.value.remote_traceback


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_local_dispatch_and_combine_never_sync_the_host(mode):
    """Decode steps are captured in CUDA graphs: the local low-latency path must not read back. Nor does the normal
    path on one rank (its T·k rows are known on the host), so a prefill step's host work runs ahead of the GPU."""
    x, ids, w = (t.cuda() for t in global_tokens(4, 1, 64, 7168, 256, 8, dtype=torch.bfloat16))
    gs = torch.tensor(448 * 6 / 5.0, device="cuda")
    for payload in ("bf16", "nvfp4"):
        d = create_dispatcher("local", 256, 7168, mode=mode, num_max_dispatch_tokens_per_rank=64)
        tokens = d.quantize(x, payload, gs)
        layout, handle = d.dispatch(tokens, ids, w, payload)  # warm-up (kernel compilation)
        y = with_hidden(layout, torch.zeros(layout.hidden.shape[:-1] + (7168,), dtype=torch.bfloat16, device="cuda"))
        d.combine(y, handle)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layout, handle = d.dispatch(tokens, ids, w, payload)
            d.combine(y, handle)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_stopping_the_parent_stops_the_ranks(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("from pdlab.moe.dispatch.spawn import run_ranks\n"
            "from pdlab.moe.dispatch.selftest import sleep_on_rank\n"
            "if __name__ == '__main__':\n"
            f"    run_ranks(sleep_on_rank, 2, kwargs={{'seconds': 120, 'pid_dir': {str(tmp_path)!r}}}, backend='gloo')\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while len(list(tmp_path.glob("rank*"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*")]
    assert len(pids) == 2, "ranks did not start"
    parent.send_signal(signal.SIGTERM)  # what `timeout` sends
    parent.wait(timeout=30)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.time() + 15
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "ranks outlived their parent"
