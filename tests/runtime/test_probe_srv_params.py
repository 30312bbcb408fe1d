"""A 400 of the server's own checks names the field of the request that was sent: a chat's too-long prompt is its
`messages` and its output limit `max_completion_tokens` when that was sent, /generate's are `text` / `input_ids` and
`sampling_params.*` (they were `prompt` and `max_tokens`, fields these requests do not have)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import CTX, client, server  # noqa: E402,F401  (fixtures: a toy server per module)


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


@pytest.mark.parametrize("path,extra,needle", [
    ("/v1/completions", {"n": 2}, "n=2 is not supported: one choice per request"),
    ("/v1/chat/completions", {"n": 3}, "n=3 is not supported: one choice per request"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty is not supported: send 0 or leave it out"),
    ("/v1/chat/completions", {"frequency_penalty": -1.0}, "frequency_penalty is not supported: send 0 or leave it out"),
    ("/v1/completions", {"best_of": 2}, "best_of is not supported by this server"),
    ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias is not supported by this server"),
    ("/v1/completions", {"suffix": "x"}, "suffix is not supported by this server"),
    ("/v1/chat/completions", {"tools": []}, "tools is not supported by this server"),
    ("/v1/chat/completions", {"tool_choice": "none"}, "tool_choice is not supported by this server"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format is not supported"),
])
def test_an_openai_feature_the_server_lacks_is_named_as_unsupported(client, path, extra, needle):
    """n > 1 and the penalties were refused as 'Input should be less than or equal to 1 / 0' (a penalty of 0.5 then
    -0.5 both refused, neither saying why); best_of, tools, response_format... as unknown fields, as if misspelt."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == next(iter(extra)), err


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
@pytest.mark.parametrize("stop_id", [-1, 10**9])
def test_a_stop_token_id_outside_the_vocabulary_is_a_400(client, path, stop_id):
    """A stop token id the model can never sample was accepted and could never stop the request."""
    body = ({"prompt": "x", "stop_token_ids": [2, stop_id]} if path == "/v1/completions"
            else {"text": "x", "sampling_params": {"stop_token_ids": [2, stop_id]}})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "stop_token_ids must be in [0, " in err["message"] and f"got {stop_id}" in err["message"], err
    assert err["param"].endswith("stop_token_ids"), err
