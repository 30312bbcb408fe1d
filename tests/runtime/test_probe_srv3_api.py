"""The HTTP API at its edges, as a new client tries it: the native /generate route holds to the same request limits as
the OpenAI routes."""

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
