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
    settings = dict(device="cpu", page_size=16, max_total_tokens=4096, max_context_len=256, max_running_requests=8,
                    chunked_prefill_size=100, max_prefill_tokens=350, role=role)
    return LLM(model=m, tokenizer=tok, model_config=cfg, **{**settings, **kw})


@pytest.mark.parametrize("role", ["colocated", "prefill"])
def test_warmup_runs_the_ladder_and_leaves_nothing(role):
    llm = _llm(role)
    sched = llm.scheduler
    # totals 1, 2, 4, … 256 and 350 tokens, as prompts of at most the 100-token chunk
    assert sched.warmup_batches() == [[1], [2], [4], [8], [16], [32], [64], [64, 64], [86, 85, 85],
                                      [88, 88, 87, 87]]
    original = sched.hooks, sched.metrics, sched.on_output
    hooks, metrics, sent = _Refuse(), _Count(), []
    sched.hooks, sched.metrics, sched.on_output = hooks, metrics, sent.append
    res = sched.warmup()
    assert (res["requests"], res["tokens"]) == (16, 1 + 2 + 4 + 8 + 16 + 32 + 64 + 128 + 256 + 350)
    assert sched.hooks is hooks and sched.metrics is metrics and sched.on_output == sent.append
    assert metrics.calls == 0 and sent == []
    assert not sched.by_rid and not sched.has_work
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity
    sched.hooks, sched.metrics, sched.on_output = original
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0]["token_ids"]) == (3 if role == "colocated" else 1)  # serving works afterwards


def test_warmup_adds_the_step_sizes_of_each_expert_launch(monkeypatch):
    # a model's MoE experts name the prefill sizes at which a new kernel variant starts (Engine.warmup_token_counts):
    # each becomes a warm-up batch of its own, between the powers of two
    llm = _llm("colocated")
    assert llm.engine.warmup_token_counts(350) == []  # the toy has no MoE layer
    monkeypatch.setattr(llm.engine, "warmup_token_counts", lambda top: [1, 3, 43, 171])
    assert llm.scheduler.warmup_batches() == [[1], [2], [3], [4], [8], [16], [32], [43], [64], [64, 64], [86, 85],
                                              [86, 85, 85], [88, 88, 87, 87]]
    res = llm.scheduler.warmup()
    assert res["tokens"] == 1 + 2 + 3 + 4 + 8 + 16 + 32 + 43 + 64 + 128 + 171 + 256 + 350


def test_warmup_skips_decode_role_and_refuses_a_busy_scheduler():
    assert _llm("decode").scheduler.warmup()["requests"] == 0
    llm = _llm("colocated")
    llm.scheduler.add_request(Req([5, 6, 7], SamplingParams(temperature=0, max_tokens=2)))
    with pytest.raises(RuntimeError, match="before the first request"):
        llm.scheduler.warmup()


def test_warmup_batches_shrink_to_the_free_pages_and_request_limit():
    llm = _llm("colocated")
    sched = llm.scheduler
    pool = llm.engine.pool
    held = pool.allocate(pool.num_free_pages - 2 * pool.allocator.pages_for(90))
    assert sched.warmup_batches()[-2:] == [[86, 85], [88, 88]]  # two prompts' pages left
    pool.free(held)
    few = _llm("colocated", max_running_requests=2).scheduler.warmup_batches()
    assert max(len(b) for b in few) == 2


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


def test_a_failing_warmup_says_so_and_leaves_nothing(monkeypatch):
    llm = _llm("colocated")
    eng = llm.engine

    def broken(batch, *a, **k):
        raise RuntimeError("out of memory in the MoE layer")

    monkeypatch.setattr(eng, "forward", broken)
    with pytest.raises(RuntimeError, match="warm-up .* failed: internal error: RuntimeError: out of memory"):
        llm.scheduler.warmup()
    assert not llm.scheduler.by_rid and eng.pool.num_free_pages == eng.pool.allocator.capacity


def test_step_log_names_every_step_and_the_warm_up(tmp_path, monkeypatch):
    """PDLAB_STEP_LOG: one JSON line per step, warm-up steps flagged; a prompt's prefill step carries its tokens and
    each later token one decode step."""
    import json
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PDLAB_STEP_LOG", str(log))
    llm = _llm("colocated")
    warm = llm.scheduler.warmup()
    out = llm.generate([[5] * 37], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 6
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    warmup, served = [r for r in recs if r["warmup"]], [r for r in recs if not r["warmup"]]
    assert sum(r["tokens"] for r in warmup if r["kind"] == "prefill") == warm["tokens"]
    assert [(r["kind"], r["bs"], r["tokens"]) for r in served] == [("prefill", 1, 37)] + [("decode", 1, 1)] * 5
    for r in recs:
        assert r["role"] == "colocated" and min(r["schedule_ms"], r["forward_ms"], r["process_ms"]) >= 0
        assert set(r) == {"t", "role", "pid", "kind", "bs", "tokens", "schedule_ms", "forward_ms", "process_ms",
                          "waiting", "running", "warmup", "reserved_mib"}
        assert r["reserved_mib"] is None  # on CUDA: the allocator's reserved MiB
    assert [r["t"] for r in recs] == sorted(r["t"] for r in recs)
