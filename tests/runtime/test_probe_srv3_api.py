"""The HTTP API at its edges, as a new client tries it: the native /generate route holds to the same request limits as
the OpenAI routes."""

import json
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import _server  # noqa: E402


@pytest.fixture(scope="module")
def client():
    srv = _server()
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
        yield c
    srv.stop()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "stop"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, "sampling_params.stop"),
])
def test_more_than_16_stop_strings_is_a_400_on_every_route(client, path, body, param):
    """/generate took any number of stop strings (each one is searched for after every token) while the OpenAI routes
    refused more than 16; now every route refuses them with a 400 naming its own field."""
    stops = [f"s{i}" for i in range(17)]
    if path == "/generate":
        body = {**body, "sampling_params": {**body["sampling_params"], "stop": stops}}
    else:
        body = {**body, "stop": stops}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "at most 16 stop strings, got 17" in err["message"], err
    # 16 are served
    if path == "/generate":
        body["sampling_params"]["stop"] = stops[:16]
    else:
        body["stop"] = stops[:16]
    assert client.post(path, json=body).status_code == 200


@pytest.fixture(scope="module")
def pd_router():
    """A prefill server, a decode server (embedded tiny model, CPU) and the router in front of them; yields the
    router's URL."""
    from pdlab.runtime.disagg.launch import serve_role, serve_router
    from pdlab.runtime.router.router import RouterConfig
    from pdlab.runtime.supervisor import ChildSpec, Supervisor

    base = dict(device="cpu", max_total_tokens=4096, log_level="warning", port=0, transfer_timeout=5.0)
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([ChildSpec(role, serve_role, args=({**base, "role": role},))
                          for role in ("prefill", "decode")])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0)
        acks.update(sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))]))
        yield acks["router"]["url"]
    finally:
        sup.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_generate_through_the_router_names_the_request_by_the_clients_id(pd_router, stream):
    """A /generate request's meta_info.id is the client's `rid` (or X-Request-Id); through a prefill/decode pair it
    was the router's transfer id ("pd-..."), so a client could not match answers to its requests."""
    body = {"input_ids": [5, 6, 7], "stream": stream, "sampling_params": {"max_new_tokens": 3}}
    with httpx.Client(base_url=pd_router, timeout=60) as c:
        for extra, headers, want in (({"rid": "mine-1"}, {}, "mine-1"), ({}, {"X-Request-Id": "trace-9"}, "trace-9")):
            r = c.post("/generate", json={**body, **extra}, headers=headers)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                ids = {e["meta_info"]["id"] for e in events}
            else:
                ids = {r.json()["meta_info"]["id"]}
            assert ids == {want}, r.text
        r = c.post("/generate", json={**body, "stream": False})  # no id of the client's: the server's own
        assert r.status_code == 200 and r.json()["meta_info"]["id"].startswith("pd-"), r.text
