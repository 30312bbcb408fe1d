"""Scheduler edge paths: abort in every state frees everything; the role hooks the disaggregation
roles use (prefill hand-off + release, decode preallocate + kv_ready / kv_failed)."""

import pytest
import torch

from pdlab.runtime.core import FinishReason, Req, ReqStatus, SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.testing import load_toy
from pdlab.runtime.scheduler.scheduler import RoleHooks


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _llm(hooks=None, **kw):
    m, tok, cfg = load_toy(max_position_embeddings=128)
    settings = dict(device="cpu", page_size=16, max_total_tokens=160, max_context_len=128, chunked_prefill_size=16,
                    max_prefill_tokens=32, decode_reserve_tokens=0)
    settings.update(kw)
    return LLM(model=m, tokenizer=tok, model_config=cfg, hooks=hooks, **settings)


def _req(n, max_tokens=40, seed=0):
    return Req([(7 * i + seed) % 250 + 1 for i in range(n)], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                              ignore_eos=True))


def _all_free(llm):
    pool = llm.engine.pool
    return pool.num_free_pages == pool.allocator.capacity and not llm.scheduler.by_rid


def test_abort_in_every_state_frees_everything():
    llm = _llm()
    s = llm.scheduler
    outs = []
    s.on_output = outs.append
    reqs = [_req(60, seed=i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    seen = set()
    for _ in range(400):
        s.step()
        for r in reqs:
            if not r.finished and r.status not in seen and r.status in (ReqStatus.PREFILLING, ReqStatus.RUNNING,
                                                                        ReqStatus.RETRACTED, ReqStatus.WAITING):
                seen.add(r.status)
                s.abort(r.rid)
                s.check_invariants()
        if all(r.finished for r in reqs):
            break
    assert {ReqStatus.PREFILLING, ReqStatus.RUNNING, ReqStatus.WAITING} <= seen
    assert all(r.finished for r in reqs) and _all_free(llm)
    finals = [o for o in outs if o.finished]
    assert sorted(o.rid for o in finals) == sorted(r.rid for r in reqs)  # exactly one final output each
    assert not s.abort("unknown-rid")


def test_abort_of_a_retracted_request_drops_its_backup():
    llm = _llm()
    s = llm.scheduler
    reqs = [_req(50, max_tokens=60, seed=i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    for _ in range(500):
        s.step()
        parked = [r for r in reqs if r.status == ReqStatus.RETRACTED]
        if parked:
            victim = parked[0]
            assert victim.backup is not None and not victim.pages
            s.abort(victim.rid)
            assert victim.backup is None and victim.finish_reason == FinishReason.ABORT
            break
    else:
        pytest.fail("no request was retracted")
    while s.has_work:
        s.step()
    assert _all_free(llm)


class TakeOver(RoleHooks):
    def __init__(self):
        self.taken = []

    def on_prefill_done(self, sched, req):
        self.taken.append(req)
        return True


def test_prefill_role_hand_off_keeps_pages_until_release():
    hooks = TakeOver()
    llm = _llm(hooks, role="prefill")
    s = llm.scheduler
    r = _req(40)
    s.add_request(r)
    while s.has_work:
        s.step()
    assert hooks.taken == [r] and r.status == ReqStatus.HANDED_OFF and len(r.output_ids) == 1
    assert r.pages and r.table_row == -1 and r.rid in s.parked
    s.check_invariants()
    s.release(r.rid)
    assert _all_free(llm)


def test_prefill_role_without_a_hook_finishes_after_the_first_token():
    llm = _llm(role="prefill")
    out = llm.generate([list(range(1, 30))], SamplingParams(temperature=0, max_tokens=20))
    assert len(out[0]["token_ids"]) == 1 and _all_free(llm)


def test_decode_role_preallocate_then_kv_ready_equals_colocated():
    """A decode server whose KV is 'written by a peer' (here: copied from a colocated run's pool)
    continues exactly like the colocated run."""
    prompt = _req(37).prompt_ids
    colo = _llm(max_total_tokens=1024)
    ref = colo.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]["token_ids"]
    # prefill side: compute the prompt KV and the first token, keep the pages
    hooks = TakeOver()
    pre = _llm(hooks, role="prefill", max_total_tokens=1024)
    pr = Req(list(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    pre.scheduler.add_request(pr)
    while pre.scheduler.has_work:
        pre.scheduler.step()
    dec = _llm(role="decode", max_total_tokens=1024)
    dr = Req(list(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), rid="t1")
    pages = dec.scheduler.preallocate(dr)
    assert pages is not None and dr.status == ReqStatus.WAITING_FOR_KV
    for src, dst in zip(pre.engine.pool.kv_caches, dec.engine.pool.kv_caches):  # the "transfer"
        for a, b in zip(pr.pages, pages):
            dst[b] = src[a]
    pre.scheduler.release(pr.rid)
    outs = []
    dec.loop.add_sink("t1", outs.append)
    dec.loop.call(lambda s: s.kv_ready("t1", pr.output_ids[0]))
    while not (outs and outs[-1].finished):
        dec.loop.run_once()
    assert [t for o in outs for t in o.token_ids] == ref
    assert _all_free(dec) and _all_free(pre)


def test_decode_role_kv_failed_and_preallocate_limits():
    dec = _llm(role="decode", max_total_tokens=160, max_running_requests=2)
    a, b, c = (Req(_req(20, seed=i).prompt_ids, SamplingParams(max_tokens=5), rid=f"r{i}") for i in range(3))
    assert dec.scheduler.preallocate(a) and dec.scheduler.preallocate(b)
    assert dec.scheduler.preallocate(c) is None  # max_running_requests reached
    outs = []
    dec.scheduler.on_output = outs.append
    dec.scheduler.kv_failed("r0", "peer died")
    assert outs[-1].finished and outs[-1].error == "peer died" and outs[-1].finish_reason == FinishReason.ERROR
    dec.scheduler.abort("r1")
    dec.scheduler.kv_ready("r1", 5)  # arrives after the abort: ignored
    assert _all_free(dec)
    big = Req(list(range(1, 120)), SamplingParams(max_tokens=5), rid="big")
    assert dec.scheduler.preallocate(big) is not None
    assert dec.scheduler.preallocate(Req(list(range(1, 100)), SamplingParams(max_tokens=5), rid="x")) is None  # no pages


def test_a_failing_step_fails_only_its_batch():
    llm = _llm(max_total_tokens=1024)
    model = llm.engine.model
    real = model.forward
    state = {"fail": True}

    def flaky(ids, pos, ctx):
        if state["fail"] and not ctx.is_decode:
            state["fail"] = False
            raise RuntimeError("injected")
        return real(ids, pos, ctx)

    model.forward = flaky
    out = llm.generate([list(range(1, 20)), list(range(5, 30))], SamplingParams(temperature=0, max_tokens=4))
    assert out[0]["finish_reason"] == "error" and "injected" in out[0]["error"]
    assert out[0]["finish_reason"] == out[1]["finish_reason"]  # both were in the failed prefill batch
    again = llm.generate([list(range(1, 20))], SamplingParams(temperature=0, max_tokens=4))[0]
    assert again["finish_reason"] == "length" and len(again["token_ids"]) == 4 and _all_free(llm)


def test_pages_held_by_parked_requests_make_others_wait_not_fail():
    hooks = TakeOver()
    llm = _llm(hooks, role="prefill", max_total_tokens=160, max_running_requests=8)
    s = llm.scheduler
    reqs = [_req(60, seed=i) for i in range(4)]  # 4 pages each; the pool has 10
    for r in reqs:
        s.add_request(r)
    for _ in range(100):
        s.step()
    assert len(hooks.taken) == 2 and all(r.status == ReqStatus.HANDED_OFF for r in hooks.taken)
    assert not any(r.finished for r in reqs)  # the others wait for pages, none failed
    for r in list(hooks.taken):
        s.release(r.rid)
    for _ in range(100):
        s.step()
    assert len(hooks.taken) == 4
    for r in hooks.taken[2:]:
        s.release(r.rid)
    assert _all_free(llm)
