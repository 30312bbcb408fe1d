"""Disaggregated generation (prefill engine -> KV transfer -> decode engine) against the colocated
server, token for token, with the toy model whose logits depend on every stored KV row; plus the
failure cases: dead prefill, client abort, layout mismatch, KV pressure on the decode side."""

import sys
import time
from pathlib import Path

import pytest

from pdlab.runtime.core import Req, SamplingParams
from pdlab.runtime.disagg.offline import DisaggLLM
from pdlab.runtime.disagg.roles import State
from pdlab.runtime.disagg.transfer.nixl import available as nixl_available
from pdlab.runtime.engine.loop import LLM
sys.path.insert(0, str(Path(__file__).parent))
from disagg_children import load_sensitive_toy  # noqa: E402

MODEL, TOK, CFG = load_sensitive_toy()
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def _settings(page=16, kv="auto", tokens=4096, chunk=32, **kw):
    return dict(model=MODEL, tokenizer=TOK, model_config=CFG, device="cpu", page_size=page, kv_dtype=kv,
                max_total_tokens=tokens, chunked_prefill_size=chunk, max_prefill_tokens=max(64, chunk), **kw)


def _prompts(page=16, chunk=32):
    # short, page-boundary lengths, longer than one prefill chunk
    lens = [1, 3, page - 1, page, page + 1, 2 * page, chunk + 5, 3 * chunk + 7]
    return [[(7 * i + 3 * n) % 256 for i in range(n)] for n in lens]


def _colocated(prompts, params=GREEDY, **kw):
    return [r["token_ids"] for r in LLM(**_settings(**kw)).generate(prompts, params)]


def _submit_long(d, tid, results, n=150):
    """One request of n prompt tokens (several prefill chunks) submitted to both roles of `d`."""
    long = [3] * n
    d.decode_role.submit(Req(long, GREEDY, rid=tid), tid, "prefill-0", lambda out: results.setdefault("out", out))
    d.prefill_role.submit(Req(long, GREEDY, rid=tid), tid)


def _pump_until(d, done, seconds=10.0):
    """Run both servers' loops until done() or the deadline."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        d.decode.loop.run_once()
        d.prefill.loop.run_once()
        time.sleep(0.001)


def _assert_all_pages_free(d):
    for _ in range(5):
        d.prefill.loop.run_once()
    for side in (d.decode, d.prefill):
        assert _free_pages(side) == side.scheduler.pool.allocator.capacity
        side.scheduler.check_invariants()


def _free_pages(llm):
    return llm.scheduler.pool.num_free_pages


@pytest.fixture
def disagg():
    made = []

    def make(prefill=None, decode=None, **kw):
        d = DisaggLLM(prefill or _settings(), decode or _settings(), **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.mark.parametrize("transfer", ["local", "nixl"])
def test_greedy_equals_colocated(disagg, transfer):
    if transfer == "nixl" and not nixl_available()[0]:
        pytest.skip(nixl_available()[1])
    prompts = _prompts()
    ref = _colocated(prompts)
    d = disagg(transfer=transfer, layer_group_size=1)
    out = d.generate(prompts, GREEDY)
    assert [o["error"] for o in out] == [None] * len(prompts)
    assert [o["token_ids"] for o in out] == ref
    snap_d, snap_p = d.decode_role.metrics.snapshot(), d.prefill_role.metrics.snapshot()
    assert snap_d["total"]["done"] == len(prompts) and snap_d["total"]["decoding"] == len(prompts)
    assert snap_p["total"]["transferring"] == len(prompts) and snap_p["bytes_sent"] > 0
    assert 'pdlab_disagg_requests{role="decode",state="done"} 8' in d.decode_role.metrics.prometheus()
    d.decode.scheduler.check_invariants()
    d.prefill.scheduler.check_invariants()
    assert _free_pages(d.prefill) == d.prefill.scheduler.pool.allocator.capacity  # prefill released all


def test_broken_transfer_changes_outputs(disagg, monkeypatch):
    """Negative control: if pages land in the wrong place, the outputs differ (the check can fail)."""
    prompts = _prompts()[4:]
    ref = _colocated(prompts)
    d = disagg()
    real = d.prefill_role.transfer.send_pages

    def shifted(peer, tid, src, dst, n, **kw):
        return real(peer, tid, src[::-1], dst, n, **kw)

    monkeypatch.setattr(d.prefill_role.transfer, "send_pages", shifted)
    out = d.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in out] != ref


def test_decode_retraction_page64_fp8(disagg):
    """KV pressure on the decode server (page 64, fp8): retractions happen, nothing is lost, greedy
    outputs equal a colocated run without pressure."""
    prompts = [[(5 * i + n) % 256 for i in range(n)] for n in (60, 64, 65, 100, 30, 128, 70, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ref = _colocated(prompts, params, page=64, kv="fp8", tokens=8192, chunk=64)
    d = disagg(prefill=_settings(page=64, kv="fp8", tokens=8192, chunk=64),
               decode=_settings(page=64, kv="fp8", tokens=512, chunk=64, decode_reserve_tokens=0,
                                       max_context_len=256))
    out = d.generate(prompts, params)
    assert [o["error"] for o in out] == [None] * len(prompts)
    assert [o["token_ids"] for o in out] == ref
    assert d.decode.scheduler.num_retractions > 0
    d.decode.scheduler.check_invariants()


class DeadPrefill:
    """A prefill link that took the request and the page ids, then died: never writes, never notifies."""

    def submit(self, req, tid):
        pass

    def on_pages(self, tid, meta, pages):
        pass

    def abort(self, tid):
        pass


def test_dead_prefill_fails_request_frees_pages_others_flow(disagg):
    d = disagg(transfer_timeout=1.0)

    d.link.prefills["dead"] = DeadPrefill()
    prompts = _prompts()[:4]
    ref = _colocated(prompts)
    cap = d.decode.scheduler.pool.allocator.capacity
    t0 = time.monotonic()
    out = d.generate(prompts, GREEDY, prefill=["prefill-0", "dead", "prefill-0", "prefill-0"], timeout=20)
    assert time.monotonic() - t0 < 10
    assert out[1]["finish_reason"] == "error" and "sent no KV within 1.0 s" in out[1]["error"]
    assert [out[i]["token_ids"] for i in (0, 2, 3)] == [ref[i] for i in (0, 2, 3)]
    assert _free_pages(d.decode) == cap
    d.decode.scheduler.check_invariants()
    assert d.decode_role.metrics.snapshot()["total"]["failed"] == 1


def test_unreachable_prefill_fails_fast(disagg):
    d = disagg(transfer_timeout=30.0)
    t0 = time.monotonic()
    out = d.generate([[1, 2, 3]], GREEDY, prefill=["nowhere"], timeout=20)
    assert time.monotonic() - t0 < 5
    assert "handing pages to the prefill server failed" in out[0]["error"]
    assert _free_pages(d.decode) == d.decode.scheduler.pool.allocator.capacity


def test_prefill_failure_is_reported_to_decode(disagg, monkeypatch):
    d = disagg()

    def boom(*a, **k):
        raise ValueError("device lost")

    monkeypatch.setattr(d.prefill_role.transfer, "send_pages", boom)
    out = d.generate([[4, 5, 6]], GREEDY, timeout=20)
    assert "prefill failed" in out[0]["error"] and "device lost" in out[0]["error"]
    for side in (d.decode, d.prefill):
        assert _free_pages(side) == side.scheduler.pool.allocator.capacity


def test_a_prefill_server_with_prefix_caching_sends_the_cached_prefix_too(disagg, monkeypatch):
    """The prefill server reuses the pages of a prompt's cached prefix (--enable-prefix-caching) and sends them with
    the pages it computed: the decode server gets the whole prompt's KV, greedy outputs equal colocated ones."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    system = [(3 * i + 1) % 250 for i in range(40)]
    prompts = [system + [(5 * i + k) % 250 for i in range(n)] for k, n in enumerate((1, 16, 23))]
    ref = _colocated(prompts)
    d = disagg(prefill=_settings(enable_prefix_caching=True))
    out = d.generate(prompts[:1], GREEDY) + d.generate(prompts[1:], GREEDY)
    assert [o["token_ids"] for o in out] == ref
    assert d.prefill.scheduler.prefix_cache.hit_tokens >= 2 * 32  # the two later prompts: two pages of 16 each
    # the decode server's answers say what the prefill server's cache served (its own has none)
    assert [o["cached_tokens"] for o in out] == [0, 32, 32]
    _assert_all_pages_free(d)


def test_client_abort_frees_pages_on_both_sides(disagg):
    d = disagg()
    results = {}
    tid = "abort-me"
    _submit_long(d, tid, results)  # several prefill chunks: still computing when the client goes away
    for _ in range(3):
        d.decode.loop.run_once()
        d.prefill.loop.run_once()
    time.sleep(0.05)
    d.decode.loop.run_once()
    assert d.decode_role.records[tid].state in (State.WAITING, State.TRANSFERRING, State.BOOTSTRAPPING)
    d.decode_role.abort(tid)
    _pump_until(d, lambda: "out" in results)
    assert results["out"].finished and results["out"].error == "client disconnected"
    # answered at once; the decode pages go once the prefill side's final notice says it stopped writing them
    _pump_until(d, lambda: d.decode_role.records[tid].state is State.ABORTED)
    _assert_all_pages_free(d)
    # counted as aborted on both sides, not as a failure of either server
    assert d.prefill_role.records[tid].state is State.ABORTED
    for role in (d.decode_role, d.prefill_role):
        snap = role.metrics.snapshot()
        assert snap["total"]["aborted"] == 1 and snap["total"]["failed"] == 0, snap
        assert f'pdlab_disagg_requests{{role="{role.metrics.role}",state="aborted"}} 1' in role.metrics.prometheus()
    # and the servers keep serving
    assert d.generate([[1, 2]], GREEDY)[0]["token_ids"] == _colocated([[1, 2]])[0]


def test_direct_scheduler_abort_keeps_pages_until_the_prefill_stops_writing(disagg):
    """A plain `Scheduler.abort` (not the role's own abort path) on a request whose KV is in flight
    must not free its pages while the prefill may still write them: the role hook defers it."""
    d = disagg()
    results = {}
    tid = "direct-abort"
    _submit_long(d, tid, results)
    _pump_until(d, lambda: tid in d.decode.scheduler.parked)
    assert d.decode_role.records[tid].state in (State.WAITING, State.TRANSFERRING)
    held = list(d.decode.scheduler.parked[tid].pages)
    assert held
    assert d.decode.scheduler.abort(tid, "operator abort")
    assert tid in d.decode.scheduler.parked and d.decode.scheduler.parked[tid].pages == held, \
        "pages freed while the prefill may still write them"
    assert "out" not in results
    _pump_until(d, lambda: "out" in results)
    assert results["out"].finished and results["out"].error == "operator abort"
    _assert_all_pages_free(d)
    assert d.decode_role.records[tid].state is State.ABORTED


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_request_the_prefill_server_refused_ends_at_once(disagg, order):
    """The router reports a prefill server's 4xx to the decode server (`refused_status`): the request ends with that
    status at once and its pages are free, instead of waiting for KV until the transfer timeout (30 s here). The
    refusal may also overtake the request ("before"): the request then ends as it arrives."""
    d = disagg(transfer_timeout=30.0)
    results = {}
    tid = f"refused-{order}"
    why = "the prefill server http://p refused the request (400): the prompt exceeds its context"
    submit = lambda: d.decode_role.submit(Req([3] * 40, GREEDY, rid=tid), tid, "prefill-0",  # noqa: E731
                                          lambda out: results.setdefault("out", out))
    t0 = time.monotonic()
    if order == "before":
        d.decode_role.abort(tid, why, refused_status=400)
        d.decode.loop.run_once()
        submit()
    else:
        submit()  # the prefill server never gets it
        _pump_until(d, lambda: tid in d.decode.scheduler.parked)
        assert d.decode_role.records[tid].state is State.WAITING
        d.decode_role.abort(tid, why, refused_status=400)
    _pump_until(d, lambda: "out" in results, seconds=5.0)
    out = results["out"]
    assert out.finished and out.error == why and out.error_status == 400
    assert time.monotonic() - t0 < 5.0
    _assert_all_pages_free(d)
    if order == "after":  # a refused request failed: it is not one its client gave up on
        assert d.decode_role.records[tid].state is State.FAILED
    assert d.generate([[1, 2]], GREEDY)[0]["token_ids"] == _colocated([[1, 2]])[0]


def test_pages_for_a_transfer_the_prefill_server_failed_are_refused(disagg):
    """Without the router's word: the prefill server (a shorter context) refused the request, then the decode server
    hands it the pages: the hand-off is refused with the prefill's reason, and the decode side fails the request
    then, not at the transfer timeout (30 s here)."""
    d = disagg(prefill=_settings(max_context_len=64), decode=_settings(max_context_len=512), transfer_timeout=30.0)
    results = {}
    tid = "refused-by-prefill"
    with pytest.raises(ValueError, match="context is 64 tokens"):
        d.prefill_role.submit(Req([3] * 100, GREEDY, rid=tid), tid)
    t0 = time.monotonic()
    d.decode_role.submit(Req([3] * 100, GREEDY, rid=tid), tid, "prefill-0", lambda out: results.setdefault("out", out))
    _pump_until(d, lambda: "out" in results, seconds=5.0)
    out = results["out"]
    assert out.finished and "failed on the prefill server" in out.error and "context is 64 tokens" in out.error
    assert out.error_status == 400  # the request's own fault, as the prefill server found it
    assert time.monotonic() - t0 < 5.0
    _assert_all_pages_free(d)


def test_a_prefill_server_that_stops_passes_its_503_to_the_client(disagg):
    """A prefill server stopping ends the requests it still computes with a 503; the decode side answered 502
    ("prefill failed"), which reads as a broken server rather than one going away."""
    d = disagg()
    results = {}
    tid = "prefill-stops"
    _submit_long(d, tid, results)  # several prefill chunks: still computing when the server stops
    _pump_until(d, lambda: d.prefill_role.records[tid].peer_meta is not None)
    assert "out" not in results
    d.prefill_role.abort(tid, "server is shutting down; retry the request on another server", error_status=503)
    _pump_until(d, lambda: "out" in results)
    out = results["out"]
    assert out.finished and out.error_status == 503 and "shutting down" in out.error, out
    _assert_all_pages_free(d)


def test_layout_mismatch_rejected_unless_converted(disagg):
    prompts = _prompts()[:5]
    d = disagg(prefill=_settings(page=16), decode=_settings(page=32))
    out = d.generate(prompts[:1], GREEDY, timeout=20)
    assert "KV layouts differ" in out[0]["error"] and "page_size 16" in out[0]["error"]
    d2 = disagg(prefill=_settings(page=16), decode=_settings(page=32), convert=True)
    assert [o["token_ids"] for o in d2.generate(prompts, GREEDY)] == _colocated(prompts)


def test_real_tiny_model_greedy_equals_colocated(disagg):
    """The embedded tiny DeepSeek-V3 (MLA through mla_prefill / mla_decode, MoE): disaggregated
    greedy outputs equal colocated ones, for a page-boundary prompt and one longer than a chunk."""
    import torch

    from pdlab.runtime.model import load_model

    model, tok, cfg = load_model(None, torch.device("cpu"), torch.float32)
    s = dict(model=model, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=1024,
             chunked_prefill_size=32, max_prefill_tokens=64, max_context_len=256)
    prompts = [[(11 * i + 5) % 200 for i in range(n)] for n in (16, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    ref = [r["token_ids"] for r in LLM(**s).generate(prompts, params)]
    out = disagg(prefill=dict(s), decode=dict(s)).generate(prompts, params)
    assert [o["token_ids"] for o in out] == ref and all(len(r) == 5 for r in ref)


def test_lost_page_handoff_times_out_on_both_sides(disagg, monkeypatch):
    """The page ids never reach the prefill: the decode request fails after the timeout, and the
    prefill releases the pages of its finished prompt instead of holding them forever."""
    d = disagg(transfer_timeout=1.0)
    monkeypatch.setattr(d.link, "send_pages", lambda prefill, msg: None)  # lost on the way
    t0 = time.monotonic()
    out = d.generate([[1, 2, 3, 4]], GREEDY, timeout=20)
    assert "sent no KV within 1.0 s" in out[0]["error"] and time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while d.prefill_role.metrics.snapshot()["current"]["failed"] == 0 and time.monotonic() < deadline:
        d.prefill.loop.run_once()
        time.sleep(0.01)
    assert "no page ids from the decode server" in next(iter(d.prefill_role.records.values())).error
    assert d.decode_role.metrics.snapshot()["total"]["failed"] == 1  # a timeout is a fault, not an abort
    assert d.decode_role.metrics.snapshot()["total"]["aborted"] == 0
    for side in (d.decode, d.prefill):
        assert _free_pages(side) == side.scheduler.pool.allocator.capacity
        side.scheduler.check_invariants()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_tiny_model_two_gpus_greedy_equals_colocated(disagg):
    """Prefill engine on cuda:0, decode engine on cuda:1 (bf16, page 64, fp8 decode pool too)."""
    import torch

    from pdlab.runtime.model import load_model

    prompts = [[(13 * i + 1) % 200 for i in range(n)] for n in (1, 63, 64, 65, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for kv in ("bf16", "fp8"):
        sides = []
        for dev in ("cuda:0", "cuda:1"):
            model, tok, cfg = load_model(None, torch.device(dev), torch.bfloat16)
            sides.append(dict(model=model, tokenizer=tok, model_config=cfg, device=dev, page_size=64, kv_dtype=kv,
                              max_total_tokens=8192, chunked_prefill_size=128, max_prefill_tokens=256,
                              max_context_len=512, disable_cuda_graph=True))
        # one prompt at a time: batch size 1 on both paths, so bf16 kernels see the same shapes
        colocated, d = LLM(**sides[1]), disagg(prefill=sides[0], decode=sides[1])
        ref = [colocated.generate([p], params)[0]["token_ids"] for p in prompts]
        out = [d.generate([p], params)[0] for p in prompts]
        assert [o["error"] for o in out] == [None] * len(prompts)
        assert [o["token_ids"] for o in out] == ref, kv
