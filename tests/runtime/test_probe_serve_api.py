"""The OpenAI-compatible front as a client sees it, at the edges: a request that fails after its first token, a
`model` the server does not serve, and JSON values of the wrong type (booleans and strings are not numbers)."""

import json
import os
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import SlowToy, ToyModel, _server  # noqa: E402

PATHS = ["/v1/completions", "/v1/chat/completions", "/generate"]


class LateFailingToy(ToyModel):
    """Toy model whose forward raises once a sequence reaches position 8: the prompt's prefill and the first
    decode steps succeed, so the request has tokens when it fails (a kernel failure, not the request's)."""

    def forward(self, input_ids, positions, ctx):
        if bool((positions >= 8).any()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().forward(input_ids, positions, ctx)


def _body(path: str, n: int, stream: bool = False, **extra) -> dict:
    """A request for `n` tokens (EOS ignored) to `path`, with a 3-token prompt for the completions routes."""
    if path == "/generate":
        return {"input_ids": [5, 6, 7], "stream": stream,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": stream, **extra}
    return {"prompt": [5, 6, 7], "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def late_failing():
    srv = _server(LateFailingToy)
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
        yield srv, c
    srv.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_step_that_fails_after_the_first_token_is_a_500_not_a_partial_200(late_failing, path):
    """The failure came as a 200 with finish_reason "error" (or "abort") and the partial text: a client could not
    tell it from an answer. Now a 500 with the server_error body naming the cause and how far the request got."""
    srv, c = late_failing
    r = c.post(path, json=_body(path, 20))
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "server_error" and err["code"] == 500, err
    assert "internal error: RuntimeError: CUDA error" in err["message"], err
    assert "after 5 generated tokens" in err["message"], err  # positions 3..7 made tokens 1..5, position 8 failed
    # a stream that fails at the same point carries the same status and cause in its error event, then [DONE]
    r = c.post(path, json=_body(path, 20, stream=True))
    assert r.status_code == 200
    ev = _events(r.text)
    assert ev[-1] == "[DONE]", ev[-3:]
    serr = json.loads(ev[-2])["error"]
    assert serr["code"] == 500 and serr["type"] == "server_error" and "CUDA error" in serr["message"], serr
    assert len(ev) - 2 == 5  # the five tokens made before the failure were streamed
    # and the server keeps serving what fits before the failing position
    ok = c.post(path, json=_body(path, 4))
    assert ok.status_code == 200, ok.text
    deadline = time.time() + 5
    while srv.scheduler.by_rid and time.time() < deadline:
        time.sleep(0.02)
    assert srv.engine.pool.num_free_pages == srv.engine.pool.allocator.capacity


def test_a_chat_that_fails_after_the_first_token_is_a_500(late_failing):
    """The chat route's prompt is its template (more than 8 tokens here): the failure comes at its first decode
    step, after the prefill made one token."""
    _, c = late_failing
    r = c.post("/v1/chat/completions", json=_body("/v1/chat/completions", 20))
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "CUDA error" in err["message"], err


@pytest.mark.parametrize("path", PATHS)
def test_a_server_stopping_under_a_non_stream_request_with_tokens_answers_503(path):
    """Stopping the server ended a non-stream request that had tokens with a 200, finish_reason "abort" and the
    partial text; now with the 503 that a stream gets in its error event, so the client knows to retry."""
    srv = _server(SlowToy)
    res: dict = {}

    def call():
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
            res["r"] = c.post(path, json=_body(path, 200))

    t = threading.Thread(target=call)
    t.start()
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not any(len(r.output_ids) >= 3 for r in list(srv.scheduler.by_rid.values())):
            time.sleep(0.01)
        assert any(len(r.output_ids) >= 3 for r in srv.scheduler.by_rid.values()), "the request made no tokens"
    finally:
        srv.stop(shutdown_timeout=0.0)
        t.join(30)
    r = res["r"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503, err
    assert "shutting down" in err["message"], err


# ---- the served model name ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    srv = _server()  # served_model_name "toy"
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
        yield c
    srv.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_model_the_server_does_not_serve_is_404(client, path, stream):
    """A `model` the server does not serve was answered by the served model, as if it were that one. vLLM and
    OpenAI answer 404 naming the model; the message also names the one served here."""
    r = client.post(path, json=_body(path, 2, stream=stream, model="gpt-4o"))
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == 404 and err["param"] == "model", err
    assert "'gpt-4o'" in err["message"] and "'toy'" in err["message"], err
    assert client.get("/v1/models").json()["data"][0]["id"] == "toy"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("model", ["toy", None])
def test_the_served_model_name_or_none_is_served(client, path, model):
    body = _body(path, 2)
    if model is not None:
        body["model"] = model
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "toy"


# ---- strict types -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,field,value,kind", [
    ("/v1/completions", "max_tokens", True, "a boolean"),
    ("/v1/completions", "max_tokens", "3", "a string"),
    ("/v1/completions", "max_tokens", 2.5, "a decimal number"),
    ("/v1/completions", "temperature", "0", "a string"),
    ("/v1/completions", "temperature", False, "a boolean"),
    ("/v1/completions", "stream", "true", "a string"),
    ("/v1/completions", "stream", 1, "an integer"),
    ("/v1/completions", "ignore_eos", 0, "an integer"),
    ("/v1/completions", "seed", True, "a boolean"),
    ("/v1/completions", "logprobs", True, "a boolean"),
    ("/v1/completions", "top_k", "5", "a string"),
    ("/v1/completions", "stop_token_ids", [True], "a boolean"),
    ("/v1/chat/completions", "logprobs", 1, "an integer"),
    ("/v1/chat/completions", "max_completion_tokens", True, "a boolean"),
    ("/v1/chat/completions", "top_logprobs", "2", "a string"),
    ("/generate", "return_logprob", "yes", "a string"),
    ("/generate", "stream", 0, "an integer"),
])
def test_a_value_of_the_wrong_json_type_is_400_naming_the_field(client, path, field, value, kind):
    """pydantic's lax mode took `"max_tokens": true` as 1, "3" as 3, "true" as true and 0 as false, and served the
    request; OpenAI refuses them. The 400 names the field and the JSON type that came."""
    r = client.post(path, json={**_body(path, 2), field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(field), err
    assert err["message"].startswith(field) and f"got {kind}" in err["message"], err


@pytest.mark.parametrize("field,value", [("max_new_tokens", True), ("temperature", "1"), ("ignore_eos", 1),
                                         ("seed", "7")])
def test_a_wrong_json_type_inside_sampling_params_is_400(client, field, value):
    body = _body("/generate", 2)
    body["sampling_params"][field] = value
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"sampling_params.{field}", r.text


@pytest.mark.parametrize("body", [
    {"prompt": [True, 5], "max_tokens": 2},
    {"prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 1}},
])
def test_a_wrong_json_type_inside_a_list_or_object_is_400(client, body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text


def test_integers_stay_valid_for_number_fields(client):
    """JSON has one number type: 1 is as good a temperature as 1.0 (and 0 a greedy one)."""
    for path in PATHS:
        body = _body(path, 2)
        if path == "/generate":
            body["sampling_params"].update(temperature=0, top_p=1, min_p=0)
        else:
            body.update(temperature=0, top_p=1, min_p=0)
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)


# ---- more edges ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_400(client, path):
    """`stream_options` belongs to a stream; OpenAI and vLLM refuse it on a non-stream request (it was ignored, so
    a client asking for usage chunks never learnt why none came)."""
    r = client.post(path, json=_body(path, 2, stream_options={"include_usage": True}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options" and "stream" in err["message"], err


@pytest.mark.parametrize("raw", ['{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
                                 '{"prompt": "x", "max_tokens": 2, "top_p": NaN}',
                                 '{"prompt": "x", "max_tokens": 2, "min_p": -Infinity}',
                                 '{"prompt": "x", "max_tokens": 2, "temperature": Infinity}'])
def test_nan_and_infinity_are_400_saying_so(client, raw):
    """Python's JSON reader takes NaN and Infinity (no JSON has them); the 400 said a NaN temperature was above 100."""
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "finite number" in r.json()["error"]["message"], r.text


def test_generate_returns_the_top_logprobs_it_was_asked_for(client):
    """`top_logprobs_num` with `return_logprob` computed the top tokens and dropped them: meta_info had only the
    chosen tokens' logprobs. Now `output_top_logprobs` has, per output token, the top [logprob, token id] pairs,
    the same as /v1/completions gives for `logprobs: n`."""
    body = _body("/generate", 4, return_logprob=True, top_logprobs_num=3)
    g = client.post("/generate", json=body).json()
    tops = g["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(g["output_ids"]) == 4 and all(len(t) == 3 for t in tops), g
    ref = client.post("/v1/completions", json={**_body("/v1/completions", 4), "logprobs": 3}).json()
    lp = ref["choices"][0]["logprobs"]
    for top, ref_lp, (chosen_lp, tok) in zip(tops, lp["token_logprobs"], g["meta_info"]["output_token_logprobs"]):
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
        assert chosen_lp == pytest.approx(ref_lp, abs=1e-5)
        assert top[0][1] == tok and top[0][0] == pytest.approx(chosen_lp)  # greedy: the chosen token is the top one
    # streamed, the last event carries the same
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        r.read()
    last = json.loads(_events(r.text)[-2])
    assert last["meta_info"]["output_top_logprobs"] == tops


def test_generate_top_logprobs_num_without_return_logprob_is_400(client):
    r = client.post("/generate", json=_body("/generate", 2, top_logprobs_num=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num", r.text


def test_an_unknown_route_names_the_routes_served(client):
    r = client.get("/v1/model")
    assert r.status_code == 404, r.text
    msg = r.json()["error"]["message"]
    assert "/v1/model" in msg and "/v1/models" in msg and "/v1/chat/completions" in msg, msg
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"], r.text


# ---- logprobs of tokens that are part of a character ----------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    """The embedded tiny model and its byte-level BPE tokenizer (single bytes of multi-byte characters are tokens)."""
    from pdlab.runtime.config import ServerConfig, build_config
    from pdlab.runtime.server.serve import Server

    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=64, max_total_tokens=4096,
                              max_context_len=1024))
    srv.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
        yield c
    srv.stop()


def test_top_logprobs_keep_every_token_that_is_part_of_a_character(embedded):
    """Each token that is a piece of a UTF-8 character decoded to "\\ufffd" on its own, so in /v1/completions'
    top_logprobs (a JSON object keyed by token text) they overwrote one another: `logprobs: 20` gave 11-19 entries.
    Such a token now reads "bytes:\\xNN..." (OpenAI's form), one text per token."""
    for seed in range(3):
        j = embedded.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16, "temperature": 1.0,
                                                  "seed": seed, "logprobs": 20, "ignore_eos": True}).json()
        lp = j["choices"][0]["logprobs"]
        # 20, or 21 where the sampled token is not among the top 20
        assert all(len(t) == 20 + (tok not in list(t)[:20]) for tok, t in zip(lp["tokens"], lp["top_logprobs"])), \
            lp["top_logprobs"]
        assert not any("\ufffd" in t for t in lp["tokens"]), lp["tokens"]


def test_chat_logprob_bytes_are_the_tokens_bytes(embedded):
    """OpenAI's `bytes` are each token's own UTF-8 bytes, so that a client can join the pieces of a character; they
    were the bytes of "\\ufffd" (ef bf bd) for every such piece, and the joined bytes did not give the text."""
    for seed in range(3):
        r = embedded.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True, "skip_special_tokens": False}).json()
        content = r["choices"][0]["logprobs"]["content"]
        joined = b"".join(bytes(x["bytes"]) for x in content)
        assert joined.decode("utf-8", "replace") == r["choices"][0]["message"]["content"], (joined, r)
        for x in content:
            assert x["token"].startswith("bytes:") or bytes(x["bytes"]) == x["token"].encode(), x
            for top in x["top_logprobs"]:
                assert top["token"].startswith("bytes:") or bytes(top["bytes"]) == top["token"].encode(), top


def test_a_messages_name_reaches_the_chat_template():
    """`name` of a chat message was accepted and dropped before the template; a template that shows participants'
    names (as vLLM passes them) now gets it, and a message without one gets none."""
    from pdlab.runtime.config import ServerConfig, build_config
    from pdlab.runtime.server.serve import Server

    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=64, max_total_tokens=4096,
                              max_context_len=1024))
    tok = srv.engine.tokenizer
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('name') %}[{{ m['name'] }}]{% endif %}"
                         "{{ m['content'] }}{% endfor %}<|assistant|>")
    srv.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
            msgs = [{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}]
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
            assert r.status_code == 200, r.text
            want = len(tok.encode("<|user|>[alice]hi<|user|>yo<|assistant|>", add_special_tokens=False))
            assert r.json()["usage"]["prompt_tokens"] == want, (r.json()["usage"], want)
    finally:
        srv.stop()


@pytest.mark.parametrize("n", [0, 1])
def test_completions_top_logprobs_hold_the_sampled_token(client, n):
    """OpenAI's completions API always returns the sampled token's logprob in top_logprobs (up to logprobs + 1
    entries); `logprobs: 0` gave empty objects, and a sampled token outside the top n was missing."""
    j = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 5.0, "seed": 3,
                                             "logprobs": n, "ignore_eos": True}).json()
    lp = j["choices"][0]["logprobs"]
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top.get(tok) == pytest.approx(chosen), (tok, chosen, top)
        assert n <= len(top) <= n + 1, top
    assert n == 0 or any(len(t) == n + 1 for t in lp["top_logprobs"])  # at temperature 5 some token is not the top
