"""A decode server told that a request's prefill server failed answers its client at once; the pages wait."""

import sys
import time
from pathlib import Path

from pdlab.runtime.core import Req
from pdlab.runtime.disagg.roles import State

sys.path.insert(0, str(Path(__file__).parent))
from test_roles import GREEDY, DeadPrefill, _assert_all_pages_free, _free_pages, _pump_until, disagg  # noqa: E402,F401


def test_the_client_of_a_request_whose_prefill_server_died_gets_its_502_at_once(disagg):  # noqa: F811
    """The router saw the prefill server's connection break and told the decode server (/disagg/abort). The request
    had its page ids handed over already (waiting for KV): its client waited the whole transfer timeout (60 s by
    default) for the 502. Now the client gets it at once; the pages stay held until the prefill side's final notice
    or the timeout, since a prefill that is only unreachable may still write them."""
    d = disagg(transfer_timeout=3.0)

    d.link.prefills["dead"] = DeadPrefill()
    results, tid = {}, "prefill-died"
    d.decode_role.submit(Req([3] * 40, GREEDY, rid=tid), tid, "dead", lambda out: results.setdefault("out", out))
    _pump_until(d, lambda: getattr(d.decode_role.records.get(tid), "state", None) is State.WAITING)
    assert d.decode_role.records[tid].state is State.WAITING
    held = list(d.decode.scheduler.parked[tid].pages)
    why = "prefill server http://127.0.0.1:1 failed: ReadError: "
    t0 = time.monotonic()
    d.decode_role.abort(tid, why, fault=True)
    _pump_until(d, lambda: "out" in results, seconds=2.0)
    assert "out" in results, "the client still waits for its answer"
    out = results["out"]
    assert out.finished and out.error == why and out.error_status == 502, out
    assert time.monotonic() - t0 < 1.0
    assert d.decode.scheduler.parked[tid].pages == held, "pages freed while the prefill may still write them"
    _pump_until(d, lambda: _free_pages(d.decode) == d.decode.scheduler.pool.allocator.capacity, seconds=6.0)
    _assert_all_pages_free(d)
    assert d.decode_role.records[tid].state is State.FAILED
    assert results["out"] is out  # one answer only
