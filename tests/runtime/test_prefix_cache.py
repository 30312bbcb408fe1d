"""Prefix caching (`--enable-prefix-caching`): the cache's bookkeeping (match, release, duplicates, LRU eviction,
references) against hand-worked cases, and whole runs of the toy model, whose logits read every stored KV row (one
wrong or missing row changes them), against the same runs without the cache: shared prefixes, a full pool that must
evict, retraction in both modes, aborts, a failed step, page sizes 1 to 64 and fp8 pools."""

import json

import pytest

from pdlab.runtime.config import ConfigError, SchedulerConfig, build_config
from pdlab.runtime.core import Req, SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.testing import load_toy
from pdlab.runtime.memory.pool import MLAKVPool

CTX = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- the cache alone ----------------------------------------------------------------------------------------------
def _pool(pages=16, page=4):
    pool = MLAKVPool(1, pages, page, "fp32", "cpu")
    return pool, pool.enable_prefix_cache()


def _finished(pool, ids, out=()):
    """A request that computed the KV of all of `ids` + `out` but the last output token, in pages of its own."""
    r = Req(list(ids), GREEDY, output_ids=list(out))
    r.cached_len = r.seq_len - 1 if out else r.seq_len
    r.pages = pool.allocate(-(-r.seq_len // pool.page_size))
    return r


def test_match_takes_whole_pages_short_of_the_last_token_and_counts_readers():
    pool, cache = _pool()
    a = _finished(pool, range(10))  # pages [0..3] [4..7] [8, 9]: two full pages are cached, the third freed
    own = list(a.pages)
    cache.release(a, keep=True)
    assert cache.num_pages == 2 and cache.evictable == 2 and pool.num_free_pages == pool.allocator.capacity
    assert pool.allocator.num_free == pool.allocator.capacity - 2 and a.pages == []
    b = Req(list(range(9)), GREEDY)  # 9 tokens: both pages (8 tokens) match, the 9th is computed
    assert cache.match(b) == 8 and b.pages == own[:2] and b.prefix_pages == 2 and b.cached_len == 8
    assert cache.evictable == 0 and pool.num_free_pages == pool.allocator.capacity - 2
    c = Req(list(range(8)), GREEDY)  # exactly two pages: the last token must be computed, so one page matches
    assert cache.match(c) == 4 and c.pages == own[:1]
    d = Req([0, 1, 2, 3, 99, 5, 6, 7, 8], GREEDY)  # differs in the second page
    assert cache.match(d) == 4
    assert cache.check([b, c, d]) == set(own[:2])
    assert cache.evict(5) == 0  # everything is read
    for r in (b, c, d):
        cache.release(r, keep=False)
    assert cache.evictable == 2 and cache.check([]) == set(own[:2])
    assert cache.hit_tokens == 16 and cache.queried_tokens == 26


def test_release_keeps_one_copy_of_the_same_tokens_and_extends_the_shared_path():
    pool, cache = _pool()
    a, b = _finished(pool, range(12)), _finished(pool, range(12))  # the same prompt computed twice at once
    cache.release(a, keep=True)
    cache.release(b, keep=True)  # its three pages duplicate a's: freed
    assert cache.num_pages == 3 and pool.allocator.num_free == pool.allocator.capacity - 3
    c = Req(list(range(20)), GREEDY)
    assert cache.match(c) == 12
    c.pages += pool.allocate(2)
    c.cached_len = 20  # computed 8 more tokens: pages 4 and 5 hold tokens 12..19
    cache.release(c, keep=True)
    assert cache.num_pages == 5 and cache.check([]) and cache.evictable == 5
    assert cache.match(Req(list(range(21)), GREEDY)) == 20


def test_eviction_takes_least_recently_used_leaves_first_and_never_a_read_page():
    pool, cache = _pool(pages=9, page=2)  # 8 usable pages
    old = _finished(pool, [1, 1, 1, 1])
    cache.release(old, keep=True)
    new = _finished(pool, [2, 2, 2, 2])
    cache.release(new, keep=True)
    assert cache.num_pages == 4
    reader = Req([2, 2, 2, 2, 2], GREEDY)
    assert cache.match(reader) == 4  # reads both of `new`'s pages
    got = pool.allocate(6)  # 4 free + 2 evicted: `old`'s, the least recently used, leaf first
    assert len(got) == 6 and cache.num_pages == 2
    assert cache.match(Req([1, 1, 1], GREEDY)) == 0 and cache.check([reader])
    with pytest.raises(Exception, match="asked for 1"):
        pool.allocate(1)  # the two left are read by `reader`: not evictable
    pool.free(got)
    cache.release(reader, keep=False)
    assert cache.clear() == 2 and pool.allocator.num_free == pool.allocator.capacity


def test_a_failed_request_is_not_cached():
    pool, cache = _pool()
    a = _finished(pool, range(12))
    cache.release(a, keep=False)
    assert cache.num_pages == 0 and pool.allocator.num_free == pool.allocator.capacity


# ---- whole runs -------------------------------------------------------------------------------------------------
SYSTEM = [(5 * i + 1) % 250 for i in range(70)]  # a shared "system prompt" of 70 tokens
PROMPTS = [SYSTEM + [(11 * i + k) % 250 for i in range(n)] for k, n in enumerate((1, 9, 30, 17, 3))]
PROMPTS += [SYSTEM[:40], SYSTEM + [7] * 5, PROMPTS[2] + [1, 2]]  # a prefix of it, a variant, an extension


def _llm(**settings):
    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    base = dict(device="cpu", max_context_len=CTX, page_size=16, chunked_prefill_size=32, max_prefill_tokens=64)
    return LLM(model=model, tokenizer=tok, model_config=cfg, **{**base, **settings})


def _ids(outs):
    return [o["token_ids"] for o in outs]


def _check_clean(llm):
    llm.scheduler.check_invariants()
    assert not llm.scheduler.by_rid and llm.engine.pool.num_free_pages == llm.engine.pool.allocator.capacity


@pytest.mark.parametrize("page,kv", [(1, "fp32"), (4, "fp32"), (16, "fp32"), (16, "fp8"), (64, "fp32")])
def test_outputs_equal_a_run_without_the_cache_and_the_prefix_is_computed_once(page, kv, monkeypatch):
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    settings = dict(page_size=page, kv_dtype=kv, **({"kv_scale": 0.05} if kv == "fp8" else {}))
    ref = _ids(_llm(**settings).generate(PROMPTS, GREEDY))
    llm = _llm(enable_prefix_caching=True, **settings)
    first = llm.generate(PROMPTS[:1], GREEDY)  # computes and caches the system prompt
    rest = llm.generate(PROMPTS[1:], GREEDY)
    assert _ids(first + rest) == ref
    again = llm.generate(PROMPTS, GREEDY)  # every prompt cached now, up to its last whole page
    assert _ids(again) == ref
    _check_clean(llm)
    stats = llm.scheduler.stats()
    assert stats["prefix_cache_pages"] > 0
    # the second round alone served each prompt's whole pages short of its last token from the cache
    second = sum((len(p) - 1) // page * page for p in PROMPTS)
    first_round = sum((len(p) - 1) // page * page for p in PROMPTS[1:] if p[:len(SYSTEM)] == SYSTEM)
    assert stats["prefix_cache_hit_tokens"] >= second + min(first_round, 1)


def test_a_request_reuses_the_pages_another_still_running_request_has_computed(monkeypatch):
    """Pages join the cache after each prefill chunk: a request that arrives while the first one is still prefilling
    the same system prompt (in 32-token chunks) starts from the pages computed so far, not from nothing, and waits a
    step rather than compute a page the first one computes in that step."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    a, b = PROMPTS[2], PROMPTS[3]  # 100 and 87 tokens, the same first 70
    ref = _ids(_llm().generate([a, b], GREEDY))
    llm = _llm(enable_prefix_caching=True)
    s, outs = llm.scheduler, {}
    s.on_output = lambda out: outs.setdefault(out.rid, []).extend(out.token_ids)
    s.add_request(Req(list(a), GREEDY, rid="a"))
    s.step()  # a: tokens 0..31 computed, two pages shared at once
    assert s.by_rid["a"].prefix_pages == 2 and s.prefix_cache.num_pages == 2
    s.add_request(Req(list(b), GREEDY, rid="b"))
    s.step()  # a: its second chunk, pages 2 and 3, which b's next page is: b waits for them (it would compute them)
    assert not s.by_rid["b"].pages and s.by_rid["b"] in s.waiting and s.prefix_cache.hit_tokens == 0
    s.step()  # a: its third chunk; b admitted with a's first four pages (its 70 shared tokens end in page 4)
    assert s.by_rid["b"].pages[:4] == s.by_rid["a"].pages[:4] and s.prefix_cache.hit_tokens == 64
    assert s.by_rid["b"].cached_len == len(b)  # and computed its other 23 tokens in that step
    while s.has_work:
        s.step()
    assert [outs["a"], outs["b"]] == ref
    _check_clean(llm)


@pytest.mark.parametrize("mode", ["backup", "recompute"])
def test_a_full_pool_evicts_cached_pages_and_retracts_requests_that_share_them(mode, monkeypatch):
    """A pool of about two maximal requests: cached pages must be evicted for new ones, and the running requests,
    which share the system prompt's pages, are retracted and resumed; outputs equal the unpressured run's."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _ids(_llm(max_total_tokens=4096).generate(PROMPTS, params))
    llm = _llm(enable_prefix_caching=True, max_total_tokens=CTX + 32, decode_reserve_tokens=0, retract_mode=mode)
    got = _ids(llm.generate(PROMPTS, params))
    assert got == ref
    assert llm.scheduler.num_retractions >= 1, "the pool did not force retractions"
    assert _ids(llm.generate(PROMPTS[::-1], params)) == ref[::-1]
    _check_clean(llm)


def test_an_aborted_request_keeps_serving_its_computed_prefix_and_a_failed_step_caches_nothing(monkeypatch):
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    ref = _ids(_llm().generate(PROMPTS[:3], GREEDY))
    llm = _llm(enable_prefix_caching=True)
    s = llm.scheduler
    s.add_request(Req(list(PROMPTS[0]), GREEDY, rid="gone"))
    s.step()  # its first 32-token chunk is computed
    assert s.by_rid["gone"].cached_len == 32
    s.abort("gone")
    assert s.prefix_cache.num_pages == 2  # its two computed pages are kept
    assert _ids(llm.generate(PROMPTS[:3], GREEDY)) == ref
    _check_clean(llm)
    # a step that fails: its requests' pages are not cached (their KV may be half written)
    before = s.prefix_cache.num_pages
    real = llm.engine.forward

    def broken(batch):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(llm.engine, "forward", broken)
    out = llm.generate([[9] * 50], GREEDY)
    assert "injected device fault" in out[0]["error"]
    assert s.prefix_cache.num_pages == before
    monkeypatch.setattr(llm.engine, "forward", real)
    assert _ids(llm.generate(PROMPTS[:3], GREEDY)) == ref
    _check_clean(llm)


def test_real_tiny_deepseek_with_the_cache_equals_without():
    """The embedded tiny DeepSeek-V3 (MLA through mla_prefill over a cached prefix, MoE): greedy outputs with the
    prefix cache equal those without it."""
    import torch

    from pdlab.runtime.model import load_model

    model, tok, cfg = load_model(None, torch.device("cpu"), torch.float32)
    s = dict(model=model, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=1024,
             chunked_prefill_size=32, max_prefill_tokens=64, max_context_len=256)
    system = [(13 * i + 3) % 200 for i in range(40)]
    prompts = [system + [(7 * i + k) % 200 for i in range(n)] for k, n in enumerate((5, 21))]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ref = _ids(LLM(**s).generate(prompts, params))
    llm = LLM(enable_prefix_caching=True, **s)
    got = _ids(llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params))
    assert got == ref and llm.scheduler.prefix_cache.hit_tokens >= 32


def test_a_decode_server_refuses_prefix_caching():
    with pytest.raises(ConfigError, match="enable it on the prefill server"):
        build_config(SchedulerConfig, role="decode", enable_prefix_caching=True)
    assert build_config(SchedulerConfig, role="prefill", enable_prefix_caching=True).enable_prefix_caching


def test_metrics_report_the_cache_only_when_it_is_on():
    from pdlab.runtime.server.metrics import RuntimeMetrics

    llm = _llm(enable_prefix_caching=True)
    llm.generate(PROMPTS[:1], GREEDY)
    llm.generate(PROMPTS[1:2], GREEDY)
    text = RuntimeMetrics().render(llm.scheduler.stats())
    hits = llm.scheduler.prefix_cache.hit_tokens
    assert hits >= 64 and f"pdlab_prefix_cache_hit_tokens_total {hits}" in text
    assert f"pdlab_prefix_cache_pages {llm.scheduler.prefix_cache.num_pages}" in text
    assert "pdlab_kv_cache_usage_ratio 0.0" in text  # cached pages no request reads are free
    assert "prefix_cache" not in RuntimeMetrics().render(_llm().scheduler.stats())


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_the_books_and_never_share_wrong_kv(page, seed):
    """Random requests over a small alphabet (so that prefixes repeat) are admitted, computed in chunks, finished,
    failed or retracted while other allocations force evictions. Each page records the tokens written to it; after
    every operation the cache's counts must agree with the live requests, every page must have exactly one owner,
    and every page a request shares must hold exactly that request's tokens."""
    import random

    rng = random.Random(seed)
    pool, cache = _pool(pages=40, page=page)
    content: dict[int, tuple] = {}  # page -> the tokens whose KV it holds
    live: list[Req] = []
    held: list[int] = []  # pages taken by "other" allocations

    def write(r, upto):  # compute r's tokens [cached_len, upto) into its own pages
        need = -(-upto // page) - len(r.pages)
        r.pages += pool.allocate(need)
        for pos in range(r.cached_len, upto):
            i = pos // page
            assert i >= r.prefix_pages, "a request wrote into a shared page"
            content[r.pages[i]] = content.get(r.pages[i], ())[:pos % page] + (r.token_at(pos),)
        r.cached_len = upto

    def books():
        cached = cache.check(live)
        own = [p for r in live for p in r.pages[r.prefix_pages:]]
        assert len(own) == len(set(own)) and not cached & set(own) and not cached & set(held)
        assert pool.allocator.capacity - pool.allocator.num_free == len(own) + len(cached) + len(held)
        for r in live:
            for i, p in enumerate(r.pages[:r.prefix_pages]):
                assert content[p] == tuple(r.tokens(i * page, (i + 1) * page)), "shared KV of other tokens"

    for _ in range(300):
        op = rng.random()
        if op < 0.35 and len(live) < 4:
            r = Req([rng.choice((1, 2)) for _ in range(rng.randint(1, 12))], GREEDY)
            pool_before = pool.num_free_pages
            cache.match(r)
            assert r.cached_len < r.seq_len, "matched the whole sequence: no token left to compute logits from"
            if -(-r.seq_len // page) - len(r.pages) > pool.num_free_pages:
                cache.unmatch(r)  # does not fit: not admitted
                assert pool.num_free_pages == pool_before
            else:
                live.append(r)
        elif op < 0.6 and live:
            r = rng.choice(live)
            if r.cached_len < r.seq_len:
                upto = min(r.seq_len, r.cached_len + rng.randint(1, 5))
                if -(-upto // page) - len(r.pages) <= pool.num_free_pages:
                    write(r, upto)
                    cache.insert_computed(r)
        elif op < 0.8 and live:
            r = live.pop(rng.randrange(len(live)))
            cache.release(r, keep=rng.random() < 0.8)
            r.cached_len = 0
        elif op < 0.9:
            n = rng.randint(1, 6)
            if n <= pool.num_free_pages:
                got = pool.allocate(n)  # evicts cached pages as needed
                for p in got:
                    content.pop(p, None)
                held += got
        elif held:
            k = rng.randint(1, len(held))
            pool.free(held[:k])
            del held[:k]
        books()
    assert cache.hit_tokens > 0 and cache.num_pages >= 0


def test_a_burst_behind_one_system_prompt_computes_it_once(monkeypatch):
    """Requests arriving together, all behind the same system prompt: without deferral each computed it in the same
    step (none was cached yet). The first computes it; the others wait one step and read its pages; outputs equal
    a run without the cache."""
    monkeypatch.setenv("PDLAB_CHECK_INVARIANTS", "1")
    burst = [SYSTEM + [(3 * i + k) % 250 for i in range(10 + k)] for k in range(5)]  # 70 shared + 10..14 own
    ref = _ids(_llm(max_prefill_tokens=1024, chunked_prefill_size=512).generate(burst, GREEDY))
    llm = _llm(enable_prefix_caching=True, max_prefill_tokens=1024, chunked_prefill_size=512)
    computed = []
    real = llm.engine.forward
    monkeypatch.setattr(llm.engine, "forward",
                        lambda batch: (computed.append(0 if batch.is_decode else batch.num_tokens), real(batch))[1])
    assert _ids(llm.generate(burst, GREEDY)) == ref
    # the first request computes all of its 80 tokens; the others their tokens past the 64 shared (4 pages of 16)
    assert sum(computed) == len(burst[0]) + sum(len(p) - 64 for p in burst[1:])
    _check_clean(llm)


def test_flush_cache_endpoint_evicts_the_unread_pages():
    import httpx

    from pdlab.runtime.config import ServerConfig
    from pdlab.runtime.server.serve import Server

    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    for cache in (True, False):
        srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048,
                                  max_context_len=CTX, enable_prefix_caching=cache, api_key="k"),
                     model=model, tokenizer=tok, model_config=cfg)
        srv.start()
        try:
            base, auth = f"http://127.0.0.1:{srv.port}", {"Authorization": "Bearer k"}
            with httpx.Client(timeout=30, headers=auth) as c:
                body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
                assert c.post(f"{base}/generate", json=body).status_code == 200
                assert httpx.post(f"{base}/flush_cache").status_code == 401  # the key guards it as any route
                r = c.post(f"{base}/flush_cache")
                if cache:
                    assert r.status_code == 200 and r.json() == {"flushed_pages": 4, "cached_pages": 0}, r.text
                    assert srv.loop.scheduler.prefix_cache.num_pages == 0
                    assert c.post(f"{base}/flush_cache").json()["flushed_pages"] == 0
                else:
                    assert r.status_code == 400 and "--enable-prefix-caching" in r.json()["error"]["message"]
        finally:
            srv.stop()


def test_each_response_says_how_many_prompt_tokens_came_from_the_cache():
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field), /generate's meta_info.cached_tokens and the
    offline results' cached_tokens: the prompt tokens a request read from the prefix cache; absent (None) on a server
    without one."""
    import httpx

    from pdlab.runtime.config import ServerConfig
    from pdlab.runtime.server.serve import Server

    llm = _llm(enable_prefix_caching=True)
    first, second = llm.generate(PROMPTS[0:1], GREEDY)[0], llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 64)  # 79 tokens: 4 whole pages of the 70 shared
    assert _llm().generate(PROMPTS[0:1], GREEDY)[0]["cached_tokens"] is None
    model, tok, cfg = load_toy(max_position_embeddings=CTX)
    for cache in (True, False):
        srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048,
                                  max_context_len=CTX, enable_prefix_caching=cache),
                     model=model, tokenizer=tok, model_config=cfg)
        srv.start()
        try:
            base = f"http://127.0.0.1:{srv.port}"
            with httpx.Client(timeout=30) as c:
                usages = [c.post(f"{base}/v1/completions", json={"prompt": p, "max_tokens": 2}).json()["usage"]
                          for p in PROMPTS[0:2]]
                meta = c.post(f"{base}/generate", json={"input_ids": PROMPTS[2], "sampling_params": {
                    "max_new_tokens": 2}}).json()["meta_info"]
                with c.stream("POST", f"{base}/v1/completions", json={
                        "prompt": PROMPTS[3], "max_tokens": 2, "stream": True,
                        "stream_options": {"include_usage": True}}) as r:
                    chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
                streamed = json.loads(chunks[-1][6:])["usage"]
        finally:
            srv.stop()
        if cache:
            assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 64]
            assert meta["cached_tokens"] == 64 and streamed["prompt_tokens_details"] == {"cached_tokens": 64}
        else:
            assert all("prompt_tokens_details" not in u for u in usages + [streamed])
            assert "cached_tokens" not in meta
