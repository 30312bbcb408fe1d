"""Retraction under KV pressure: no request lost or duplicated, greedy outputs identical to a run
without pressure, for every allocator x KV dtype x page size, with CPU backup and with recompute."""

import pytest

from pdlab.runtime.core import SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.testing import load_toy

PROMPTS = ["The quick brown fox", "a" * 61, "page boundary " * 5, "x", "MLA latent rows " * 3,
           "0123456789" * 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
CTX = 128
_REF: dict = {}




def _run(**settings):
    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    llm = LLM(model=model, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, **settings)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.scheduler.check_invariants()
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity, "pages leaked"
    assert not llm.scheduler.by_rid and not llm.scheduler.waiting
    return outs, llm


COMBOS = [("token", 1), ("paged", 1), ("paged", 16), ("paged", 64)]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("allocator,page", COMBOS, ids=[f"{a}-p{p}" for a, p in COMBOS])
@pytest.mark.parametrize("mode", ["backup", "recompute"])
def test_greedy_identical_under_pressure(allocator, page, kv_dtype, mode, monkeypatch):
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    common = dict(page_size=page, kv_dtype=kv_dtype, allocator=allocator, chunked_prefill_size=32,
                  max_prefill_tokens=64, retract_mode=mode, **_fp8_scale(kv_dtype))
    key = (allocator, page, kv_dtype)
    if key not in _REF:  # the pressure-free run does not depend on the retraction mode
        _REF[key] = _run(max_total_tokens=4096, **common)[0]
    ref = _REF[key]
    # one maximal request (128 tokens) fits, plus a little: the six requests need ~600 tokens
    tight = max(CTX + page, 160) if page < 64 else 3 * 64
    got, llm = _run(max_total_tokens=tight, decode_reserve_tokens=0, **common)
    assert llm.scheduler.num_retractions >= 2, "the pool did not force retractions"
    for r, g, p in zip(ref, got, PROMPTS):
        assert g["finish_reason"] == "length" and len(g["token_ids"]) == 40
        assert g["token_ids"] == r["token_ids"], f"prompt {p!r} diverged after retraction"
        assert g["text"] == r["text"]


def test_many_retractions_page64_fp8(monkeypatch):
    """The pressure case of the issue: page size 64, fp8 KV, a pool of three pages, ten requests."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    prompts = [("req %d " % i) * (3 + 4 * i % 11) for i in range(10)]  # 18..78 tokens
    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    outs = {}
    for total in (8192, 3 * 64):
        llm = LLM(model=model, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, page_size=64,
                  kv_dtype="fp8", kv_scale=0.05, max_total_tokens=total, chunked_prefill_size=48,
                  max_prefill_tokens=96, decode_reserve_tokens=0 if total < 8192 else 16)
        outs[total] = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        if total < 8192:
            assert llm.scheduler.num_retractions >= 5
    assert [o["token_ids"] for o in outs[8192]] == [o["token_ids"] for o in outs[3 * 64]]


def test_batching_does_not_change_greedy_outputs():
    batched, _ = _run(max_total_tokens=4096, page_size=16)
    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    llm = LLM(model=model, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, page_size=16,
              max_total_tokens=4096)
    for p, b in zip(PROMPTS, batched):
        assert llm.generate([p], GREEDY)[0]["token_ids"] == b["token_ids"]


def test_a_broken_restore_is_caught(monkeypatch):
    """Fault injection: if a restore skipped copying the rows back, outputs must differ (the test above
    would catch such a bug). Freed pages are poisoned (PDLAB_CHECK_INVARIANTS), so stale rows show."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    from pdlab.runtime.memory.pool import MLAKVPool
    common = dict(page_size=16, kv_dtype="bf16", chunked_prefill_size=32, max_prefill_tokens=64)
    ref, _ = _run(max_total_tokens=4096, **common)
    monkeypatch.setattr(MLAKVPool, "copy_from_cpu", lambda self, pages, backup: None)
    got, llm = _run(max_total_tokens=160, decode_reserve_tokens=0, **common)
    assert llm.scheduler.num_retractions > 0
    assert [g["token_ids"] for g in got] != [r["token_ids"] for r in ref]


@pytest.mark.parametrize("kv_dtype,page", [("bf16", 16), ("fp8", 64)])
def test_overlap_schedule_gives_identical_outputs(kv_dtype, page, monkeypatch):
    """Overlap mode (decode step k+1 launched before step k is processed) under pressure, with stop
    strings, stop ids and varied max_tokens: same tokens and texts as the plain loop, no page leak."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 7, 25, 1, 33, 12)]
    base = dict(page_size=page, kv_dtype=kv_dtype, chunked_prefill_size=32, max_prefill_tokens=64,
                **_fp8_scale(kv_dtype))
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    plain = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, max_total_tokens=4096,
                **base).generate(PROMPTS, params)
    text = plain[0]["text"]
    params[0] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[20:23]])
    params[2] = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[plain[2]["token_ids"][9]])
    ref = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, max_total_tokens=4096,
              **base).generate(PROMPTS, params)
    for total in (4096, 3 * 64):
        llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, max_total_tokens=total,
                  decode_reserve_tokens=0, overlap_schedule=True, **base)
        got = llm.generate(PROMPTS, params)
        assert llm.scheduler.num_chained > (20 if total == 4096 else 0)
        assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref]
        assert [g["text"] for g in got] == [r["text"] for r in ref]
        assert [g["finish_reason"] for g in got] == [r["finish_reason"] for r in ref]
        while llm.scheduler.has_work:  # a step launched for requests that finished meanwhile
            llm.scheduler.step()
        assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity
    assert ref[0]["finish_reason"] == "stop" and ref[2]["finish_reason"] == "stop"


def test_overlap_abort_while_a_step_is_in_flight():
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, max_total_tokens=2048,
              page_size=16, overlap_schedule=True)
    s = llm.scheduler
    from pdlab.runtime.core import Req
    reqs = [Req(list(p.encode()), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in PROMPTS[:3]]
    for r in reqs:
        s.add_request(r)
    while s.num_chained < 3:
        s.step()
    assert s._pending is not None
    s.abort(reqs[1].rid)
    while s.has_work:
        s.step()
    assert len(reqs[0].output_ids) == 30 and len(reqs[2].output_ids) == 30 and reqs[1].finish_reason.value == "abort"
    s.check_invariants()
    assert llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity


def test_corrupted_restore_changes_greedy_outputs(monkeypatch):
    """Control for the identity tests above: if a restore brought back even one wrong KV row, the
    toy model's outputs must change, so those tests can fail."""
    from pdlab.runtime.memory.pool import MLAKVPool as KVPool

    common = dict(page_size=16, kv_dtype="bf16", allocator="paged", chunked_prefill_size=32,
                  max_prefill_tokens=64, retract_mode="backup")
    ref = _run(max_total_tokens=4096, **common)[0]
    original = KVPool.copy_from_cpu

    def corrupting(self, pages, backup):
        backup.layers[0][0, 0].neg_()  # flip one latent row of the first restored page
        return original(self, pages, backup)

    monkeypatch.setattr(KVPool, "copy_from_cpu", corrupting)
    got, llm = _run(max_total_tokens=CTX + 16, decode_reserve_tokens=0, **common)
    assert llm.scheduler.num_retractions >= 1
    assert [g["token_ids"] for g in got] != [r["token_ids"] for r in ref]


def _fp8_scale(kv_dtype: str) -> dict:
    """The KV scale setting of a cache of `kv_dtype` (only an fp8 cache takes one)."""
    return {"kv_scale": 0.05} if kv_dtype == "fp8" else {}


def test_seeded_sampling_is_the_same_with_the_overlap_schedule():
    """A seeded request at temperature > 0 draws the same tokens whether its decode steps were chained (overlap: the
    step is launched before the previous token reaches the host) or not: the noise is that of each output position."""
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(model=m, tokenizer=tok, model_config=cfg, device="cpu", max_context_len=CTX, max_total_tokens=4096,
                  page_size=16, overlap_schedule=overlap)
        outs[overlap] = [o["token_ids"] for o in llm.generate(PROMPTS[:3], params)]
        assert (llm.scheduler.num_chained > 20) == overlap
    assert outs[True] == outs[False]
