"""KV transfer backends: pages land at the right indices in every layer, layouts are checked,
conversion is exact up to fp8 rounding, every wait times out, NIXL moves CPU memory with WRITE + notify."""

import multiprocessing as mp
import sys
from pathlib import Path
import time
import uuid

import pytest
import torch

from pdlab.runtime.disagg.transfer import KVLayoutMismatch, KVTransferError, TransferStatus, TransferTimeout, create_transfer
from pdlab.runtime.disagg.transfer.base import KVLayout, convert_rows, page_slots
from pdlab.runtime.disagg.transfer.nixl import available as nixl_available

sys.path.insert(0, str(Path(__file__).parent))  # spawned children import the helpers by name
import disagg_children  # noqa: E402


def _pool(layers, pages, page, dtype=torch.float32, fill=True):
    if dtype == torch.uint8:
        return [torch.randint(0, 120, (pages, page, 576), dtype=torch.uint8) for _ in range(layers)]
    return [torch.randn(pages, page, 576).to(dtype) if fill else torch.zeros(pages, page, 576, dtype=dtype)
            for _ in range(layers)]


def _name(tag):
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _join(proc, timeout):
    """By pid: torch_shm_manager (forked by a child that shares memory) keeps its sentinel pipe open."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _pair(kind, src_pool, dst_pool, src_scale=None, dst_scale=None, convert=False, group=2):
    dst = create_transfer(kind, _name("decode"), layer_group_size=group)
    meta = dst.register(dst_pool, dst_scale)
    src = create_transfer(kind, _name("prefill"), layer_group_size=group, convert=convert)
    src.register(src_pool, src_scale)
    return src, dst, meta


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_local_pages_land_by_index(num_tokens):
    src_pool, dst_pool = _pool(5, 12, 16), _pool(5, 9, 16, fill=False)
    src, dst, meta = _pair("local", src_pool, dst_pool)
    peer = src.add_peer(meta)
    n = -(-num_tokens // 16)
    sp, dp = [11, 3, 7][:n], [2, 8, 0][:n]
    h = src.send_pages(peer, "t1", sp, dp, num_tokens, notify={"first_token": 42})
    src.wait(h, timeout=5)
    assert h.status is TransferStatus.DONE and h.num_groups == 3
    msg = dst.wait_notification("t1", timeout=5)
    assert msg == {"first_token": 42, "transfer_id": "t1"}
    for l in range(5):
        for s, d in zip(sp, dp):
            assert torch.equal(dst_pool[l][d], src_pool[l][s])
        untouched = [p for p in range(9) if p not in dp]
        assert dst_pool[l][untouched].abs().sum() == 0
    src.close(), dst.close()


def test_local_across_processes():
    dst_pool = _pool(3, 4, 8, fill=False)
    dst = create_transfer("local", _name("decode"))
    meta = dst.register(dst_pool, None)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=disagg_children.prefill_child, args=(meta, _name("prefill"), q))
    p.start()
    try:
        assert q.get(timeout=30) == "ok"
        assert dst.wait_notification("x", timeout=10)["first_token"] == 5
    finally:
        _join(p, 10)
    for l in range(3):
        assert torch.all(dst_pool[l][3] == l + 1) and torch.all(dst_pool[l][0] == l + 1)
        assert torch.all(dst_pool[l][1:3] == 0)
    dst.close()


def test_layout_mismatch_rejected_at_registration():
    src, dst, meta = _pair("local", _pool(2, 4, 16, torch.bfloat16), _pool(2, 4, 64, torch.bfloat16))
    with pytest.raises(KVLayoutMismatch, match="page_size 16 / bf16.*page_size 64 / bf16"):
        src.add_peer(meta)
    src2 = create_transfer("local", _name("p"))
    src2.register(_pool(2, 4, 64, torch.uint8), 0.5)
    with pytest.raises(KVLayoutMismatch, match="fp8"):
        src2.add_peer(meta)
    src3 = create_transfer("local", _name("p"))
    src3.register(_pool(3, 4, 64, torch.bfloat16), None)
    with pytest.raises(KVLayoutMismatch, match="layers"):
        src3.add_peer(meta)
    for t in (src, dst, src2, src3):
        t.close()


def test_local_converts_page_size_and_dtype():
    num_tokens = 70
    src_pool = _pool(2, 8, 16, torch.bfloat16)
    dst_pool = _pool(2, 3, 64, torch.uint8)
    for t in dst_pool:
        t.zero_()
    src, dst, meta = _pair("local", src_pool, dst_pool, dst_scale=0.05, convert=True)
    peer = src.add_peer(meta)
    sp, dp = [7, 0, 5, 2, 6], [2, 0]
    src.wait(src.send_pages(peer, "c", sp, dp, num_tokens), timeout=5)
    s_slots, d_slots = page_slots(sp, num_tokens, 16), page_slots(dp, num_tokens, 64)
    src_l = KVLayout.from_caches(src_pool, None)
    dst_l = KVLayout.from_caches(dst_pool, 0.05)
    for l in range(2):
        want = src_pool[l].view(-1, 576)[s_slots].float()
        got = dst_pool[l].view(-1, 576)[d_slots].view(torch.float8_e4m3fn).float() * 0.05
        ref = convert_rows(src_pool[l].view(-1, 576)[s_slots], src_l, dst_l).view(torch.float8_e4m3fn).float() * 0.05
        assert torch.equal(got, ref)
        assert (got - want).abs().max() <= 0.07 * want.abs().max()  # e4m3 rounding
    src.close(), dst.close()


def test_waits_time_out_and_dead_peer_is_an_error():
    dst = create_transfer("local", _name("decode"))
    dst.register(_pool(1, 2, 4), None)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        dst.wait_notification("never", timeout=0.3)
    assert time.monotonic() - t0 < 2
    with pytest.raises(KVTransferError, match="gone"):
        dst.notify("no-such-agent-" + uuid.uuid4().hex, {"transfer_id": "x"})
    dst.close()


def test_bad_pool_rejected():
    t = create_transfer("local", _name("x"))
    with pytest.raises(ValueError, match="kv_scale"):
        t.register(_pool(1, 2, 4, torch.uint8), None)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        t.register([torch.zeros(2, 4, 576), torch.zeros(3, 4, 576)], None)
    t.close()


# --------------------------------------------------------------------------------------------- NIXL
nixl_ok, nixl_why = nixl_available()
needs_nixl = pytest.mark.skipif(not nixl_ok, reason=f"NIXL not importable: {nixl_why}")


def test_nixl_feature_detected():
    ok, why = nixl_available()
    assert isinstance(ok, bool) and why
    if not ok:
        with pytest.raises(ImportError, match="nixl-cu13"):
            create_transfer("nixl", "x")


@needs_nixl
def test_nixl_write_and_notify_cpu():
    """Two agents: pages of a ~4 MB CPU pool written by index with WRITE + completion notification."""
    src_pool, dst_pool = _pool(4, 16, 16), _pool(4, 12, 16, fill=False)  # 4 * 16 * 16 * 576 * 4 B = 2.4 MB
    src, dst, meta = _pair("nixl", src_pool, dst_pool, group=3)
    peer = src.add_peer(meta)
    sp, dp = [15, 0, 9, 4], [1, 11, 5, 6]
    h = src.send_pages(peer, "n1", sp, dp, 60, notify={"first_token": 9})
    got = []
    deadline = time.monotonic() + 20
    # without a progress thread each side progresses in its own polls (as the roles do)
    while (src.poll(h) is TransferStatus.PROC or not got) and time.monotonic() < deadline:
        got += dst.poll_notifications()
        time.sleep(0.001)
    assert h.status is TransferStatus.DONE and h.num_groups == 2
    msg = got[0]
    assert msg == {"first_token": 9, "transfer_id": "n1"}
    for l in range(4):
        for s, d in zip(sp, dp):
            assert torch.equal(dst_pool[l][d], src_pool[l][s])
        assert dst_pool[l][[0, 2, 3]].abs().sum() == 0
    src.release(h)
    with pytest.raises(TransferTimeout):
        dst.wait_notification("n2", timeout=0.2)
    src.close(), dst.close()


@needs_nixl
def test_nixl_rejects_mismatch_and_conversion():
    with pytest.raises(ValueError, match="cannot convert"):
        create_transfer("nixl", _name("p"), convert=True)
    src, dst, meta = _pair("nixl", _pool(2, 4, 16, torch.bfloat16), _pool(2, 4, 32, torch.bfloat16))
    with pytest.raises(KVLayoutMismatch):
        src.add_peer(meta)
    src.close(), dst.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_local_cuda_ipc_between_gpus():
    ctx = mp.get_context("spawn")
    dst_pool = [torch.zeros(8, 64, 576, dtype=torch.bfloat16, device="cuda:1") for _ in range(3)]
    dst = create_transfer("local", _name("decode"))
    meta = dst.register(dst_pool, None)
    q = ctx.Queue()
    p = ctx.Process(target=disagg_children.cuda_prefill_child, args=(meta, _name("prefill"), q))
    p.start()
    try:
        assert q.get(timeout=120) == "ok"
        assert dst.wait_notification("g", timeout=30)["first_token"] == 3
    finally:
        _join(p, 30)
    for l in range(3):
        assert torch.all(dst_pool[l][5] == l + 1) and torch.all(dst_pool[l][0] == 0)




def test_bandwidth_benchmark_smoke():
    from pdlab.runtime.disagg.bench_transfer import run

    rows = run(tokens=40, layers=2, page_size=16, kv_dtype="fp8", src="cpu", dst="cpu", backend="local",
               group=1, repeats=2, warmup=1)
    assert [r["correct"] for r in rows] == [True, True]
    assert rows[0]["bytes"] == 3 * 16 * 576 * 2 and rows[0]["gb_per_s"] > 0
