"""Real HTTP tests: uvicorn on 127.0.0.1 with an ephemeral port, the toy model behind it."""

import json
import time

import httpx
import pytest
import torch

from pdlab.runtime.config import build_config, ServerConfig
from pdlab.runtime.engine.testing import ToyModel, load_toy
from pdlab.runtime.server.serve import Server

CTX = 256


class SlowToy(ToyModel):
    """Toy model with a fixed delay per step, so a stream stays open long enough to disconnect."""

    def forward(self, input_ids, positions, ctx):
        time.sleep(0.01)
        return super().forward(input_ids, positions, ctx)


class FailingToy(ToyModel):
    """Toy model whose forward raises when the batch holds token 13 (a kernel failure, not the request's)."""

    def forward(self, input_ids, positions, ctx):
        if bool((input_ids == 13).any()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().forward(input_ids, positions, ctx)


def _server(model_cls=ToyModel, **settings):
    torch.set_num_threads(1)
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    model = model_cls(cfg)
    sc = build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048, max_context_len=CTX,
                      served_model_name="toy", **settings)
    srv = Server(sc, model=model, tokenizer=tok, model_config=cfg)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def server():
    n = torch.get_num_threads()
    srv = _server()
    yield srv
    srv.stop()
    torch.set_num_threads(n)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as c:
        yield c


def _post(client, path, body):
    """POST `body` as JSON with non-ASCII escaped (\\uXXXX), as most clients send it: a lone surrogate travels too."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _sse(resp):
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_binds_localhost_by_default(server):
    assert ServerConfig().host == "127.0.0.1"
    assert server.cfg.host == "127.0.0.1"


def test_health_models_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    m = client.get("/v1/models").json()
    assert m["data"][0]["id"] == "toy" and m["data"][0]["max_model_len"] == CTX
    text = client.get("/metrics").text
    for name in ("pdlab_num_requests_waiting", "pdlab_num_requests_running", "pdlab_kv_cache_usage_ratio",
                 "pdlab_retractions_total", "pdlab_time_to_first_token_seconds_bucket",
                 "pdlab_time_per_output_token_seconds_count", "pdlab_inter_token_latency_seconds_sum",
                 "pdlab_generation_tokens_total", "pdlab_prefill_step_seconds_bucket",
                 "pdlab_decode_step_seconds_count"):
        assert name in text


def test_head_health_answers_like_get_without_a_body(client):
    """Load balancers probe with HEAD: the same status and headers as GET, no body."""
    get, head = client.get("/health"), client.head("/health")
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_x_request_id_is_echoed(client):
    """A client's X-Request-Id comes back on every response: success, stream, error, health."""
    rid = {"X-Request-Id": "trace-42"}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=rid)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "stream": True}, headers=rid)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers=rid)
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-42"
    assert client.head("/health", headers=rid).headers["x-request-id"] == "trace-42"
    assert "x-request-id" not in client.get("/health").headers  # none sent, none made up


def test_x_request_id_names_a_generate_request():
    """/generate lets a client choose its request id (`rid`); the header does the same where the body gives none,
    and a duplicate of an id in flight is refused as a duplicate `rid` is."""
    srv = _server(SlowToy)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            h = {"X-Request-Id": "gen-7"}
            r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, headers=h)
            assert r.status_code == 200 and r.json()["meta_info"]["id"] == "gen-7"
            assert r.headers["x-request-id"] == "gen-7"
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}, "stream": True}
            with c.stream("POST", "/generate", json=body, headers=h) as first:
                lines = first.iter_lines()  # kept: a dropped iterator closes the stream
                next(lines)  # in flight
                dup = c.post("/generate", json={**body, "stream": False}, headers=h)
                assert dup.status_code == 400 and "gen-7" in dup.json()["error"]["message"]
                assert dup.headers["x-request-id"] == "gen-7"
            r = c.post("/generate", json={"input_ids": [5], "rid": "body-id", "sampling_params": {"max_new_tokens": 1}},
                       headers=h)
            assert r.json()["meta_info"]["id"] == "body-id" and r.headers["x-request-id"] == "gen-7"
            r = c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
                       headers={"X-Request-Id": "x" * 201})
            assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    finally:
        srv.stop()


def _metric(client, name: str) -> float:
    line = next(ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_metrics_count_the_steps_of_a_request(client):
    """Twelve tokens: the prompt's prefill step makes the first, eleven decode steps the rest (overlapped steps are
    counted when collected)."""
    before = [_metric(client, f"pdlab_{k}_step_seconds_count") for k in ("prefill", "decode")]
    r = client.post("/v1/completions", json={"prompt": "steps", "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    # the scheduler thread records a step after handing its tokens over, so the response may arrive a moment before
    # the last step is counted: wait for it (a missing step still fails, after the deadline)
    deadline = time.monotonic() + 10.0
    while True:
        after = [_metric(client, f"pdlab_{k}_step_seconds_count") for k in ("prefill", "decode")]
        if after[1] - before[1] >= 11 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 11)
    assert _metric(client, "pdlab_decode_step_seconds_sum") > 0


def test_completion_matches_offline_greedy(client, server):
    body = {"prompt": "hello pdlab", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "text_completion" and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {"prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23}
    # the same tokens through /generate with input_ids
    g = client.post("/generate", json={"input_ids": list(b"hello pdlab"),
                                       "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
    assert g["text"] == j["choices"][0]["text"] and len(g["output_ids"]) == 12
    assert g["meta_info"]["finish_reason"] == {"type": "length"}


def test_completion_stream_with_usage(client):
    body = {"prompt": "stream me", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        r.read()
    chunks = _sse(r)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    full = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full["choices"][0]["text"]


def test_chat_stream_and_non_stream(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    j = client.post("/v1/chat/completions", json=body).json()
    assert j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant"
    assert j["usage"]["completion_tokens"] == 6
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.read()
    chunks = _sse(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == j["choices"][0]["message"]["content"]
    assert len(chunks) == 6  # one chunk per token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_generate_stream_and_logprobs(client):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        r.read()
    chunks = _sse(r)
    assert len(chunks[-1]["output_ids"]) == 5
    j = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    lp = j["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) == 2 for t in lp["top_logprobs"])


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 300}, "context"),
    ({"prompt": "y" * 300}, "context"),
    ({"prompt": "x", "bogus": 1}, "unknown field"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "empty"),
    ({"prompt": [1, 2, 99999]}, "token ids"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "ok \ud800"}, "prompt is not valid Unicode: a lone surrogate \\ud800 at character 3"),
    ({"prompt": [[1, 2], [3]]}, "prompt: expects a string, a list of token ids or a list of one string"),
    ({"prompt": "x", "stop": [1]}, "stop: expects a string or a list of strings"),
])
def test_bad_completion_requests_are_400(client, body, needle):
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400


@pytest.mark.parametrize("path,body,says", [
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 3}},
     "unknown field 'sampling_params.max_tokens'; did you mean 'sampling_params.max_new_tokens'?"),
    ("/generate", {"prompt": "x"}, "unknown field 'prompt'; did you mean 'text'?"),
    ("/v1/completions", {"prompt": "x", "max_new_tokens": 3}, "unknown field 'max_new_tokens'; did you mean "
                                                               "'max_tokens'?"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, "did you mean 'temperature'?"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "nmae": "a"}]},
     "unknown field 'messages.0.nmae'; did you mean 'messages.0.name'?"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"include_usag": True}},
     "did you mean 'stream_options.include_usage'?"),
    ("/v1/completions", {"prompt": "x", "zzzz": 1}, "unknown field 'zzzz'; remove it"),
])
def test_an_unknown_field_names_the_field_it_likely_meant(client, path, body, says):
    """An OpenAI field sent to /generate (or the reverse) and a misspelt one were 'unknown field ...; remove it', which
    leaves the client to find the name: the 400 names the field of that route it most likely meant."""
    r = _post(client, path, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 300}, "max_tokens"),  # past the context
    ({"prompt": "y" * 300}, "prompt"),  # longer than the context
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "temperature": 101}, "temperature"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_a_400_of_the_servers_own_checks_names_the_field(client, body, param):
    """The checks of the sampling parameters and of the prompt against the context name their field in `param`, as
    the schema's checks do (they gave param null)."""
    r = _post(client, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_text_that_is_not_unicode_or_of_no_accepted_type_is_400(client):
    """JSON may carry a lone UTF-16 surrogate, which no tokenizer takes (it was a 500 from inside the tokenizer); and
    a field of several types gets one message listing them, not one per type pydantic tried."""
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
              "messages[1].content is not valid Unicode: a lone surrogate \\udfff at character 0"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
              'messages.0.content: expects a string or a list of {"type": "text", "text": ...} parts'),
             ("/generate", {"text": "a\ud83d", "sampling_params": {"max_new_tokens": 2}},
              "text is not valid Unicode: a lone surrogate \\ud83d at character 1")]
    for path, body, needle in cases:
        r = _post(client, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(needle), r.json()
    # a surrogate pair is one valid character
    r = _post(client, "/v1/completions", {"prompt": "\ud83d\ude00", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_failing_step_is_a_500_and_the_server_keeps_serving():
    # the server's fault is a 5xx (clients and routers may retry it), the request's a 4xx
    srv = _server(FailingToy)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": [5, 13, 7], "max_tokens": 3})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "internal error: RuntimeError: CUDA error" in err["message"]
            r = c.post("/v1/completions", json={"prompt": [5, 13], "max_tokens": 3, "stream": True})
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            assert chunks[-1]["error"]["code"] == 500 and chunks[-1]["error"]["type"] == "server_error"
            ok = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()


def test_malformed_json_and_unknown_route(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/health").status_code == 200  # still serving


def test_disconnect_mid_stream_frees_pages():
    srv = _server(SlowToy)
    try:
        pool = srv.engine.pool
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            body = {"prompt": "a long answer please", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                it = r.iter_lines()
                got = [next(it) for _ in range(6)]
                assert any(g.startswith("data: ") for g in got)
                assert pool.num_free_pages < pool.allocator.capacity  # the request holds pages now
            deadline = time.time() + 10
            while pool.num_free_pages != pool.allocator.capacity and time.time() < deadline:
                time.sleep(0.05)
            assert pool.num_free_pages == pool.allocator.capacity, "pages not freed after disconnect"
            assert not srv.scheduler.by_rid
            assert "abort" in c.get("/metrics").text
            assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_api_key():
    srv = _server(api_key="sekret")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert c.get("/v1/models", headers={"Authorization": "bearer sekret"}).status_code == 200
            for bad in ("sekret", "Basic sekret", "Bearer sekret2", "Bearer", "Bearersekret"):
                assert c.get("/v1/models", headers={"Authorization": bad}).status_code == 401, bad
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()


def test_kept_alive_connections_are_not_delayed(client):
    """Regression: without TCP_NODELAY on accepted sockets, each response on a kept-alive connection
    waited ~40 ms for a delayed ACK (Nagle). Median of 15 requests must stay well below that."""
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        times.append(time.perf_counter() - t0)
    assert sorted(times)[7] < 0.03, times


def test_embedded_default_model_over_http():
    """`runtime serve`'s default: the embedded tiny model and its tokenizer + chat template."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=64, max_total_tokens=4096,
                              max_context_len=1024))
    srv.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "x"}]})
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
            a = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0}).json()
            b = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True})
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in b.text.splitlines()
                           if line.startswith("data: {"))
            assert text == a["choices"][0]["text"]
    finally:
        srv.stop()
        torch.set_num_threads(n)


def test_queue_limit_gives_503():
    srv = _server(SlowToy, max_queue=1)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            body = {"prompt": "hold the slot", "max_tokens": 100, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # keep the iterator: dropping it closes the stream (a disconnect)
                next(lines)
                busy = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_busy"
    finally:
        srv.stop()


def test_role_extension_points():
    """What the disaggregation roles use: extra /metrics text, and sinks for requests the loop did not add."""
    from pdlab.runtime.core import Req, SamplingParams
    from pdlab.runtime.server.api import create_app
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048,
                              max_context_len=CTX), model=m, tokenizer=tok, model_config=cfg)
    srv.app = create_app(srv.loop, srv.codec, srv.metrics, extra_metrics=lambda: "pdlab_role_state 1\n")
    srv.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            assert "pdlab_role_state 1" in c.get("/metrics").text
        got = []
        req = Req(list(b"abc"), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        srv.loop.add_sink(req.rid, got.append)
        srv.loop.call(lambda s: s.add_request(req))
        deadline = time.time() + 10
        while not (got and got[-1].finished) and time.time() < deadline:
            time.sleep(0.02)
        assert [o.token_ids for o in got][-1] and got[-1].completion_tokens == 3
    finally:
        srv.stop()


def test_disconnect_of_a_non_stream_request_frees_pages():
    srv = _server(SlowToy)
    try:
        pool = srv.engine.pool
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=0.4) as c:
            with pytest.raises(httpx.TimeoutException):
                c.post("/v1/completions", json={"prompt": "wait for me", "max_tokens": 200, "ignore_eos": True})
        deadline = time.time() + 10
        while (pool.num_free_pages != pool.allocator.capacity or srv.scheduler.by_rid) and time.time() < deadline:
            time.sleep(0.05)
        assert pool.num_free_pages == pool.allocator.capacity and not srv.scheduler.by_rid
        assert srv.metrics.finished.get("abort") == 1
    finally:
        srv.stop()
