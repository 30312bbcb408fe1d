"""A 400 of the server's own checks names the field of the request that was sent: a chat's too-long prompt is its
`messages` and its output limit `max_completion_tokens` when that was sent, /generate's are `text` / `input_ids` and
`sampling_params.*` (they were `prompt` and `max_tokens`, fields these requests do not have)."""

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import CTX, _server  # noqa: E402


@pytest.fixture(scope="module")
def client():
    srv = _server()
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as c:
        yield c
    srv.stop()


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * CTX}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": CTX}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": CTX}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": 0}, "top_k"),
    ("/generate", {"text": "y" * CTX}, "text"),
    ("/generate", {"input_ids": [1] * CTX}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": CTX}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
])
def test_a_400_names_the_field_the_request_sent(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
