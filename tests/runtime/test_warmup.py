"""Start-up warm-up: prompts of a ladder of lengths and one full prefill batch run through the scheduler
before serving (so that kernels compile then), with role hooks, metrics and outputs off, leaving nothing
behind."""

import pytest

from pdlab.runtime.core import Req, SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.testing import load_toy
from pdlab.runtime.scheduler.scheduler import RoleHooks


class _Refuse(RoleHooks):
    def on_prefill_done(self, sched, req):
        raise AssertionError("warm-up prompts must not reach the role hooks")


class _Count:
    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        def hit(*a, **k):
            self.calls += 1
        return hit


def _llm(role, **kw):
    m, tok, cfg = load_toy(max_position_embeddings=256)
    return LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=4096,
               max_context_len=256, max_running_requests=8, chunked_prefill_size=100, max_prefill_tokens=350,
               role=role, **kw)


@pytest.mark.parametrize("role", ["colocated", "prefill"])
def test_warmup_runs_the_ladder_and_leaves_nothing(role):
    llm = _llm(role)
    sched = llm.scheduler
    assert sched.warmup_lengths() == ([1, 16, 64, 100], 3, 100)  # 350 // 100 chunk-long prompts
    original = sched.hooks, sched.metrics, sched.on_output
    hooks, metrics, sent = _Refuse(), _Count(), []
    sched.hooks, sched.metrics, sched.on_output = hooks, metrics, sent.append
    res = sched.warmup()
    assert (res["requests"], res["tokens"]) == (7, 1 + 16 + 64 + 100 + 3 * 100)
    assert sched.hooks is hooks and sched.metrics is metrics and sched.on_output == sent.append
    assert metrics.calls == 0 and sent == []
    assert not sched.by_rid and not sched.has_work
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity
    sched.hooks, sched.metrics, sched.on_output = original
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0]["token_ids"]) == (3 if role == "colocated" else 1)  # serving works afterwards


def test_warmup_skips_decode_role_and_refuses_a_busy_scheduler():
    assert _llm("decode").scheduler.warmup()["requests"] == 0
    llm = _llm("colocated")
    llm.scheduler.add_request(Req([5, 6, 7], SamplingParams(temperature=0, max_tokens=2)))
    with pytest.raises(RuntimeError, match="before the first request"):
        llm.scheduler.warmup()


def test_warmup_batch_shrinks_to_the_free_pages():
    llm = _llm("colocated")
    sched = llm.scheduler
    held = llm.engine.pool.allocate(llm.engine.pool.num_free_pages - 2 * sched.pool.allocator.pages_for(102))
    lengths, batch, longest = sched.warmup_lengths()
    assert batch == 2 and longest == 100
    llm.engine.pool.free(held)


def test_server_reports_its_warmup():
    from pdlab.runtime.config import ServerConfig
    from pdlab.runtime.server.serve import Server

    m, tok, cfg = load_toy(max_position_embeddings=256)
    kw = dict(device="cpu", page_size=16, max_total_tokens=4096, max_context_len=256, chunked_prefill_size=64,
              max_prefill_tokens=128)
    srv = Server(ServerConfig(**kw), model=m, tokenizer=tok, model_config=cfg)
    assert srv.warmup is None and "warm-up: none (not on CUDA)" in srv.describe()
    srv.warmup = {"requests": 5, "tokens": 400, "seconds": 0.5}
    assert "warm-up: 5 prompts, 400 tokens in 0.5 s" in srv.describe()
    off = Server(ServerConfig(**kw, warmup=False), model=m, tokenizer=tok, model_config=cfg)
    assert "warm-up: off" in off.describe()
